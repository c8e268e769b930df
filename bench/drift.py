"""Drift-detector harness: detection delay and false alarms on synthetic exit streams.

Streams: 3 exit layers (8, 16, 24 of 30) with conditional exit rates 0.25 / 0.40 / 0.30.
Scenarios: stationary (false alarms), abrupt 0.40 -> 0.10 at layer 16, gradual 0.40 -> 0.10
over `--ramp` tokens, collapse at layer 24 (0.30 -> 0.05), spike at layer 8 (0.25 -> 0.55),
low traffic (per-minute rollups at `--low-rate` tokens/s replayed through
`detect_exit_rate_drift`). Compared with Evidently alone: `ValueDrift` on the exit-layer column
of consecutive fixed windows against a stationary reference sample (Evidently's own method
choice: Jensen-Shannon distance for a 5,000-row reference; the chi-square p-value test it uses
for small references is reported for false alarms too).

Delays are in tokens that reached the shifted layer after the shift (the target is 1,000 for
the abrupt shift) and in seconds of the whole stream at `--token-rate` tokens/s (add up to one
detection cycle, 30 s, when the service replays rollups). The last line is one JSON object.

    .venv/bin/python bench/drift.py            # default: ~1-2 minutes on 2 cores
    .venv/bin/python bench/drift.py --seeds 5 --stationary-tokens 200000   # quick
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from controlplane.drift.detectors import (
    EXIT_RATE_COLLAPSE,
    EXIT_RATE_SPIKE,
    ExitRateMonitor,
    LayerReference,
    detect_exit_rate_drift,
    layer_counts_from_exits,
)
from controlplane.drift.evidently_drift import distribution_drift_report
from controlplane.stats.synthetic import exit_stream

LAYERS = [8, 16, 24]
BASE = np.array([0.25, 0.40, 0.30])
WARMUP = 20_000  # stationary tokens before any shift


def _known_reference() -> dict[int, LayerReference]:
    return {k: LayerReference(float(r)) for k, r in zip(LAYERS, BASE, strict=True)}


def _shifted(seed: int, layer: int, new_rate: float, *, ramp: int = 0, after: int = 30_000):
    """Stream of WARMUP stationary tokens, then `after` tokens with `layer` moving to new_rate."""
    hazards = np.tile(BASE, (WARMUP + after, 1))
    j = LAYERS.index(layer)
    if ramp:
        steps = np.minimum(np.arange(after) / ramp, 1.0)
        hazards[WARMUP:, j] = BASE[j] + (new_rate - BASE[j]) * steps
    else:
        hazards[WARMUP:, j] = new_rate
    return exit_stream(hazards, rng=np.random.default_rng(seed))


def _our_delay(tokens: np.ndarray, layer: int, step: int = 10):
    """(delay in tokens of `layer`, delay in stream tokens, finding) of the first finding."""
    monitor = ExitRateMonitor(LAYERS)
    early = monitor.update(tokens[:WARMUP])
    for start in range(WARMUP, len(tokens), step):
        findings = monitor.update(tokens[start : start + step])
        if findings:
            stop = start + step
            reached = int((tokens[WARMUP:stop] >= layer).sum())
            return reached, stop - WARMUP, findings[0], len(early)
    return None, None, None, len(early)


def _evidently_flags(
    windows: list[np.ndarray], reference: np.ndarray, method: str | None = None
) -> list[bool]:
    flags = []
    for window in windows:
        report = distribution_drift_report(
            reference={"exit_layer": reference},
            current={"exit_layer": window},
            numerical_columns=(),
            methods={"exit_layer": method} if method else None,
            include_html=False,
        )
        flags.append(report.drift_detected)
    return flags


def _evidently_delay(tokens: np.ndarray, layer: int, window: int, reference: np.ndarray):
    starts = range(WARMUP, len(tokens) - window + 1, window)
    for start in starts:
        if _evidently_flags([tokens[start : start + window]], reference)[0]:
            stop = start + window
            return int((tokens[WARMUP:stop] >= layer).sum()), stop - WARMUP
    return None, None


def _summary(delays: list, rate: float, stream_delays: list) -> dict:
    found = [d for d in delays if d is not None]
    stream = [d for d in stream_delays if d is not None]
    return {
        "detected": f"{len(found)}/{len(delays)}",
        "median_tokens": float(np.median(found)) if found else None,
        "max_tokens": int(max(found)) if found else None,
        "median_seconds": float(np.median(stream) / rate) if stream else None,
    }


def _low_traffic(seeds: int, rate: float) -> dict:
    """Per-minute rollups at a low token rate; abrupt collapse at layer 24 (0.30 -> 0.10)."""
    per_minute = round(rate * 60)
    delays = []
    for seed in range(seeds):
        rng = np.random.default_rng(10_000 + seed)
        windows, detected = [], None
        for minute in range(60 + 60):
            hazards = BASE.copy() if minute < 60 else np.array([0.25, 0.40, 0.10])
            tokens = exit_stream(np.tile(hazards, (per_minute, 1)), rng=rng)
            exits = {k: int((tokens == k).sum()) for k in LAYERS}
            windows.append(layer_counts_from_exits(exits, len(tokens), LAYERS))
            if minute < 60:
                continue
            findings = detect_exit_rate_drift(reference=_known_reference(), windows=windows)
            if any(f.layer == 24 and f.kind == EXIT_RATE_COLLAPSE for f in findings):
                detected = minute - 60 + 1
                break
        delays.append(detected)
    found = [d for d in delays if d is not None]
    return {
        "tokens_per_second": rate,
        "detected": f"{len(found)}/{seeds}",
        "median_minutes": float(np.median(found)) if found else None,
        "median_seconds": float(np.median(found) * 60) if found else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--stationary-tokens", type=int, default=1_000_000)
    parser.add_argument("--token-rate", type=float, default=50.0, help="tokens/s of the stream")
    parser.add_argument("--low-rate", type=float, default=2.0, help="tokens/s, low traffic")
    parser.add_argument("--ramp", type=int, default=20_000, help="gradual shift length, tokens")
    parser.add_argument("--evidently-window", type=int, default=1_000)
    args = parser.parse_args()
    print("command:", " ".join([sys.executable, *sys.argv]))
    started = time.perf_counter()
    out: dict = {}

    stationary = exit_stream(
        np.tile(BASE, (args.stationary_tokens, 1)), rng=np.random.default_rng(7)
    )
    per_million = 1e6 / args.stationary_tokens
    t = time.perf_counter()
    learned = ExitRateMonitor(LAYERS).update(stationary)
    known = ExitRateMonitor(LAYERS, reference=_known_reference()).update(stationary)
    our_seconds = time.perf_counter() - t
    out["false_alarms_per_million"] = len(learned) * per_million
    out["false_alarms_per_million_known_reference"] = len(known) * per_million
    out["detector_seconds_per_million_tokens"] = our_seconds / 2 * per_million
    print(f"stationary {args.stationary_tokens} tokens: {len(learned)} false alarms "
          f"(learned reference), {len(known)} (known reference)")  # fmt: skip

    w = args.evidently_window
    reference = stationary[:5_000]
    windows = [stationary[s : s + w] for s in range(5_000, len(stationary) - w + 1, w)]
    t = time.perf_counter()
    flags = _evidently_flags(windows, reference)
    out["evidently_false_alarms_per_million"] = sum(flags) * 1e6 / (len(windows) * w)
    out["evidently_seconds_per_window"] = (time.perf_counter() - t) / len(windows)
    print(f"evidently: {sum(flags)} of {len(windows)} stationary windows of {w} flagged")
    # Evidently's choice on a small reference (<= 1,000 rows) is chi-square at p < 0.05.
    flags = _evidently_flags(windows, reference, method="chisquare")
    out["evidently_chisquare_false_alarms_per_million"] = sum(flags) * 1e6 / (len(windows) * w)
    print(f"evidently chi-square: {sum(flags)} of {len(windows)} stationary windows flagged")

    scenarios = {
        "abrupt": (16, 0.10, 0, EXIT_RATE_COLLAPSE),
        "gradual": (16, 0.10, args.ramp, EXIT_RATE_COLLAPSE),
        "collapse_layer24": (24, 0.05, 0, EXIT_RATE_COLLAPSE),
        "spike_layer8": (8, 0.55, 0, EXIT_RATE_SPIKE),
    }
    for name, (layer, new_rate, ramp, kind) in scenarios.items():
        ours, ours_stream, correct, early = [], [], 0, 0
        ev, ev_stream = [], []
        for seed in range(args.seeds):
            tokens = _shifted(1_000 * seed + 1, layer, new_rate, ramp=ramp)
            reached, stream, finding, n_early = _our_delay(tokens, layer)
            early += n_early
            ours.append(reached)
            ours_stream.append(stream)
            correct += finding is not None and (finding.layer, finding.kind) == (layer, kind)
            reached, stream = _evidently_delay(tokens, layer, w, tokens[:5_000])
            ev.append(reached)
            ev_stream.append(stream)
        out[name] = _summary(ours, args.token_rate, ours_stream) | {
            "layer_and_direction_correct": f"{correct}/{args.seeds}",
            "alarms_before_shift": early,
            "evidently": _summary(ev, args.token_rate, ev_stream),
        }
        print(name, json.dumps(out[name]))

    out["low_traffic"] = _low_traffic(min(args.seeds, 10), args.low_rate)
    print("low_traffic", json.dumps(out["low_traffic"]))

    out |= {
        "abrupt_delay_tokens": out["abrupt"]["median_tokens"],
        "abrupt_delay_tokens_max": out["abrupt"]["max_tokens"],
        "abrupt_delay_seconds": out["abrupt"]["median_seconds"],
        "gradual_delay_tokens": out["gradual"]["median_tokens"],
        "evidently_abrupt_delay_tokens": out["abrupt"]["evidently"]["median_tokens"],
        "evidently_gradual_delay_tokens": out["gradual"]["evidently"]["median_tokens"],
        "token_rate": args.token_rate,
        "seeds": args.seeds,
        "stationary_tokens": args.stationary_tokens,
        "seconds": round(time.perf_counter() - started, 1),
    }
    max_delay = out["abrupt_delay_tokens_max"]
    out["targets_met"] = {
        "zero_false_alarms": out["false_alarms_per_million"] == 0
        and out["false_alarms_per_million_known_reference"] == 0,
        "abrupt_within_1000_tokens": max_delay is not None and max_delay <= 1_000,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
