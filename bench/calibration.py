"""Guarantee check for Learn-Then-Test threshold selection
(`controlplane.calibration.learn_then_test`).

For each of `--trials` resamples: calibrate on fresh shadow samples, replay the chosen
thresholds on a large fresh sample and count a violation when the realised disagreement
exceeds δ (the rate must stay <= ε). The oracle picks, on that fresh sample itself, the most
aggressive step of the same threshold path whose disagreement is <= δ: the exit rate a perfect
calibrator could reach on this path. Cost is timed on 100k samples.

Synthetic samples come from `controlplane.stats.synthetic` (domains A and B, B harder). With
`--real PATH.npz` (arrays `signals` (n, L) float, `matched` (n, L) bool, `exit_layers` (L,),
optional `num_layers`, optional `domain` (n,) labels) each trial splits the real samples at
random into calibration and fresh halves, per domain when labels are given.

    .venv/bin/python bench/calibration.py                 # default: ~1 minute on 2 cores
    .venv/bin/python bench/calibration.py --real var/shadow_samples.npz

The last line is one JSON object (top-level figures: synthetic, both domains pooled).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from controlplane.calibration.learn_then_test import calibrate_thresholds
from controlplane.stats.exits import policy_outcomes
from controlplane.stats.synthetic import DEFAULT_EXIT_LAYERS, DEFAULT_NUM_LAYERS, shadow_samples


def _oracle_exit_rate(curve, signals, matched, exit_layers, delta) -> float:
    """Exit rate of the most aggressive path step with disagreement <= δ on the data itself."""
    best = 0.0
    for point in curve:
        first, disagree = policy_outcomes(
            signals, matched, [point.thresholds[k] for k in exit_layers]
        )
        if disagree.mean() <= delta:
            best = max(best, float((first < len(exit_layers)).mean()))
    return best


def _trial(cal, fresh, *, exit_layers, num_layers, delta, epsilon, seed) -> dict:
    result = calibrate_thresholds(
        signals=cal[0],
        matched=cal[1],
        exit_layers=exit_layers,
        num_layers=num_layers,
        delta=delta,
        epsilon=epsilon,
        seed=seed,
    )
    first, disagree = policy_outcomes(
        fresh[0], fresh[1], [result.thresholds[k] for k in exit_layers]
    )
    depth = np.append(exit_layers, num_layers)[first].mean()
    return {
        "realised": float(disagree.mean()),
        "exit_rate": float((first < len(exit_layers)).mean()),
        "speedup": float(num_layers / depth),
        "oracle_exit_rate": _oracle_exit_rate(result.curve, *fresh, exit_layers, delta),
        "holdout_passed": bool(result.holdout is None or result.holdout.passed),
        "bound": result.risk_bound,
    }


def _aggregate(rows: list[dict], delta: float) -> dict:
    realised = np.array([r["realised"] for r in rows])
    return {
        "trials": len(rows),
        "violation_rate": float((realised > delta).mean()),
        "realised_disagreement_mean": float(realised.mean()),
        "realised_disagreement_max": float(realised.max()),
        "exit_rate": float(np.mean([r["exit_rate"] for r in rows])),
        "oracle_exit_rate": float(np.mean([r["oracle_exit_rate"] for r in rows])),
        "speedup": float(np.mean([r["speedup"] for r in rows])),
        "holdout_pass_rate": float(np.mean([r["holdout_passed"] for r in rows])),
    }


def _synthetic(args) -> dict:
    layers = list(DEFAULT_EXIT_LAYERS)
    out, pooled = {}, []
    for d_i, domain in enumerate(("A", "B")):
        fresh = shadow_samples(args.fresh, rng=np.random.default_rng(10_000 + d_i), domain=domain)
        rows = []
        for trial in range(args.trials):
            rng = np.random.default_rng(1_000 * d_i + trial)
            cal = shadow_samples(args.samples, rng=rng, domain=domain)
            rows.append(
                _trial(
                    cal,
                    fresh,
                    exit_layers=layers,
                    num_layers=DEFAULT_NUM_LAYERS,
                    delta=args.delta,
                    epsilon=args.epsilon,
                    seed=trial,
                )
            )
        out[domain] = _aggregate(rows, args.delta)
        pooled += rows
        print(f"synthetic domain {domain}:", json.dumps(out[domain]))
    return _aggregate(pooled, args.delta) | {"domains": out}


def _real(path: str, args) -> dict:
    data = np.load(path)
    signals, matched = data["signals"].astype(float), data["matched"].astype(bool)
    layers = [int(x) for x in data["exit_layers"]]
    num_layers = int(data["num_layers"]) if "num_layers" in data else args.num_layers
    domains = data["domain"] if "domain" in data else np.zeros(len(signals), dtype=int)
    out, pooled = {}, []
    for label in np.unique(domains):
        idx = np.flatnonzero(domains == label)
        rows = []
        for trial in range(args.trials):
            perm = np.random.default_rng(trial).permutation(idx)
            half = len(perm) // 2
            cal, fresh = perm[:half], perm[half:]
            rows.append(
                _trial(
                    (signals[cal], matched[cal]),
                    (signals[fresh], matched[fresh]),
                    exit_layers=layers,
                    num_layers=num_layers,
                    delta=args.delta,
                    epsilon=args.epsilon,
                    seed=trial,
                )
            )
        out[str(label)] = _aggregate(rows, args.delta) | {"samples": len(idx)}
        pooled += rows
        print(f"real domain {label}:", json.dumps(out[str(label)]))
    return _aggregate(pooled, args.delta) | {"domains": out, "path": path}


def _seconds_per_100k(args) -> float:
    signals, matched = shadow_samples(100_000, rng=np.random.default_rng(5))
    times = []
    for seed in range(3):
        t = time.perf_counter()
        calibrate_thresholds(
            signals=signals,
            matched=matched,
            exit_layers=list(DEFAULT_EXIT_LAYERS),
            num_layers=DEFAULT_NUM_LAYERS,
            delta=args.delta,
            epsilon=args.epsilon,
            seed=seed,
        )
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--samples", type=int, default=20_000, help="shadow samples per trial")
    parser.add_argument("--fresh", type=int, default=200_000, help="fresh samples, synthetic")
    parser.add_argument("--delta", type=float, default=0.01)
    parser.add_argument("--epsilon", type=float, default=0.05)
    parser.add_argument("--real", help=".npz of real shadow samples")
    parser.add_argument("--num-layers", type=int, default=30, help="if the .npz has none")
    args = parser.parse_args()
    print("command:", " ".join([sys.executable, *sys.argv]))
    started = time.perf_counter()
    out = _synthetic(args)
    if args.real:
        out["real"] = _real(args.real, args)
    out |= {
        "delta": args.delta,
        "epsilon": args.epsilon,
        "samples_per_trial": args.samples,
        "seconds_per_100k": _seconds_per_100k(args),
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
