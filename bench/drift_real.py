"""Drift alerts on real telemetry: real per-token records of the real model, replayed through the
real detectors.

(`-P`: bench/runtime.py must not shadow the `runtime` package.)

1. Records, produced once and cached under var/drift_real/: the runtime engine (SmolLM2-135M-
   Instruct with the exit heads `exitplane demo` trains and caches under var/runtime/) serves
   requests from three text sources on this machine with shadow sampling at rate 1, so every
   token carries its learned signal and its match with full depth at every exit layer:
   `chat` (the model's own answers to questions about standard-library modules), `code`
   (continuations of Python standard-library source), `docs` (continuations of the standard
   library's docstrings). Greedy decoding under the never-exit set, i.e. the full model's own
   text; a served token's exit under any threshold set follows from its signals.
   Prompts (`_prompts`): chat asks about each of the 549 module names, then each name again
   with the other of the two asks; code (docs) takes 48 tokens at token 200 of each file's
   source (long docstrings), files from the end of the list, then a second window at token 600
   of each file long enough, left out when it repeats an earlier prompt (the generated
   encodings/*.py open alike: the first 480 code prompts hold 420 distinct ones). Files whose
   text the exit heads were trained on (`trained_files`: the first 13 at the demo heads'
   60,000 characters) give no window; none of the first 480 came from them. A longer list keeps
   a shorter one as its prefix, so a larger `--requests` serves only the prompts past the
   largest cached file of its source and appends them (chat 960 / code 975 at most). Each
   request's `group` (its module; its file, files sharing an identical prompt joined) is saved
   with the records: requests of one group are correlated.
2. Traffic: for each source a threshold set calibrated on half of its requests (the fixed-
   sequence Learn-Then-Test the calibrator uses, δ and ε below); the other half is replayed.
   Requests arrive as a Poisson stream at `--request-rate`, each one a whole request resampled
   with replacement, its tokens spaced over the request's decode time; a token is a shadow
   token with probability `--shadow-rate`. Minute rollups, the signal histogram and shadow
   samples (with request ids) are built as the ingestion builds them.
3. The detectors: every `--check-every-s` the same code as the `drift.detect` task
   (`controlplane.drift.service.evaluate`, on in-memory windows instead of SQL reads) and the
   same fallback
   rule (`controlplane.flows.fallback.decide`) run over the lookback, and alerts open,
   refresh and clear as `controlplane.alerts.service.reconcile` does.

Episodes: stationary stretches of each source under its own set (`--hours` in all, replayed in
episodes of at most `--episode-hours`), and abrupt switches from one source to another (every
ordered pair, `--switches` times each) after `--warmup-min` minutes of the home source.

The replay rate, `--token-rate` 300 tokens/s for the whole deployment, is one runtime at modest
load: a single runtime of this model serves hundreds to thousands of tokens/s (the fleet issue
sizes a runtime at 2,000 tokens/s) and a deployment has one runtime or more, so 300 is the low
end of production traffic, with 90 shadow tokens/s at the default shadow rate 0.3 (0.05 at 300
tokens/s gives 15 shadow tokens/s: run `--shadow-rate 0.05` for the thin end). The 6 tokens/s
of the issue's first try was one person's test on a CPU box, not a deployment. Detection time
depends on it: the detectors need a given number of requests' worth of evidence, so run
`--token-rate 30 / 100 / 1000` for the curve (docs/benchmarks.md).

What limits detection (measured): (1) the token rate: a switch that moves
disagreement a little above δ (chat -> code: 6.5% vs 5%) needs a few thousand effective shadow
tokens at the per-look level, about a minute of traffic at 300 tokens/s and more than twenty
at 30; (2) the window: a single 10-minute quality window dilutes a new shift with the old
traffic (after t seconds only t/600 of it is new: a median of 735 s with that window
alone), so the quality test also looks at the last 1 and 3 minutes (their looks share one
hourly false-alarm budget: `controlplane.drift.window_checks`); (3) the cadence: detection is
quantised to the 30 s check; exit-rate moves above the minimum effect are found at the first
check from 300 tokens/s; (4) the design effect costs little here (1.6-1.7 for disagreement,
about 5.5 for exit rates at 300 tokens/s); the minimum counts do not bind above 30 tokens/s.
Cost, not statistics, limited the cadence: ADWIN was fed every token of the 30-minute
lookback at every check (seconds per check at 300 tokens/s); it now sees a capped number per
rollup (`ExitRateMonitor`).

Cadence: after a switch the detectors run every `--shift-check-every-s` (30 s, the drift
beat); stationary stretches are checked every `--check-every-s` (default 30 s as well, the
production cadence, so that false alarms are counted on every look production makes; a larger
value saves time but samples fewer looks). The quality test's per-look level is always that
of the production cadence (`DriftOptions.check_interval_s`).

Reported:

- `false_alarms_per_hour`: alerts (warning or critical; info findings do not page) fired during
  stationary traffic, per simulated hour of it (warm-up stretches before switches included);
- `false_fallbacks`: fallbacks decided while the true disagreement (all tokens, not only the
  shadow ones) of the window that decided it is within δ: the quality window the
  `quality_regression` names (1, 3 or 10 minutes), the recent window for an exit-rate spike's
  gate. `fallbacks_recent_window_within_delta` counts, for comparison, fallbacks whose whole
  recent (10-minute) window is within δ: a shift caught in its first minute is one of those,
  since nine minutes of the old traffic still dilute it;
- `shift_detect_s_median` / `missed_shifts`: over switches that change the true disagreement
  above δ or a conditional exit rate by at least the detectors' minimum effect, seconds from the
  switch to the first alert, and switches with no alert within `--after-min` minutes;
- `hours`: simulated hours of traffic replayed.

    .venv/bin/python -P bench/drift_real.py                 # records cached after the first run
    .venv/bin/python -P bench/drift_real.py --records-only  # just produce the records
    # bench/segments.py's records: 480 more requests per source on top of the 480 cached,
    # about 5 minutes per 240 requests and source (one core each, 2026-12-01)
    .venv/bin/python -P bench/drift_real.py --records-only --sources chat code --requests 960
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

SOURCES = ("chat", "code", "docs")
RECORDS_DIR = Path("var/drift_real")


# -- 1. records ------------------------------------------------------------------------------

CHAT_ASKS = ("What is the Python module `{}` used for? Answer briefly.",
             "Give a short example that uses Python's `{}` module.")
SECOND_WINDOW_AT = 600  # tokens into a file (or its docstrings): well past the first window (200)


def _module_names(count: int) -> list[str]:
    from runtime import corpus

    names = sorted({p.stem if p.stem != "__init__" else p.parent.name
                    for p in corpus.stdlib_files()} - {"__main__", "this", "antigravity"})
    return names[::-1][:count]


def trained_files(max_chars: int) -> int:
    """How many files of `corpus.stdlib_files()` the exit heads' training text reads: a prefix,
    since `corpus.stdlib_texts(max_chars)` walks them in order (a module's docstrings, then its
    source[:4000]), up to the file of the last text it yields."""
    import ast

    from runtime import corpus

    texts = list(corpus.stdlib_texts(max_chars))
    files, read = corpus.stdlib_files(), 0  # texts[:read] are placed in files[:index]
    for index, path in enumerate(files):
        try:
            source = path.read_text(encoding="utf-8")
            ast.parse(source)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue
        if not source:
            continue
        head = source[:4000]
        if texts[read] == head:  # no docstring excerpt
            read += 1
        elif read + 1 < len(texts) and texts[read + 1] == head:  # docstrings, then source
            read += 2
        elif read == len(texts) - 1:  # its docstrings: the budget ran out before its source
            read += 1
        else:
            raise RuntimeError(f"corpus.stdlib_texts no longer reads {path.name} as expected")
        if read >= len(texts):
            return index + 1
    return len(files)


def _prompts(source: str, tokenizer, count: int, prompt_tokens: int, *,
             trained_chars: int) -> tuple[list[list[int]], list[int]]:
    """`count` prompts of one source and the group of each (chat: the module; code and docs:
    the file), from text the exit heads were not trained on (`trained_chars`: the heads'
    `stdlib_chars`). Chat asks about each module name, then each name again with the other ask;
    code and docs take a window at token 200 of each file (its source or its long docstrings),
    then a second window at `SECOND_WINDOW_AT` of each file long enough. The first N prompts
    are the same for any count (cached records of a smaller count stay a prefix)."""
    import ast

    from runtime import corpus

    if source == "chat":
        names = _module_names(count)
        asked = [(i, CHAT_ASKS[i % 2]) for i in range(len(names))]
        asked += [(i, CHAT_ASKS[(i + 1) % 2]) for i in range(len(names))]
        asked = asked[:count]
        return ([corpus.chat_prompt_ids(tokenizer, ask.format(names[i])) for i, ask in asked],
                [i for i, _ in asked])
    files = corpus.stdlib_files()
    skip = trained_files(trained_chars)
    texts = []  # (file index, token ids), files from the end, away from the trained ones
    for index in range(len(files) - 1, skip - 1, -1):
        try:
            text = files[index].read_text(encoding="utf-8")
            if source == "docs":
                tree = ast.parse(text)
                docs = [ast.get_docstring(node) for node in ast.walk(tree)
                        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)]
                text = "\n\n".join(d for d in docs if d and len(d) > 200)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= prompt_tokens:
            texts.append((index, ids))
        if len(texts) >= count:
            break
    by_file = dict(texts)

    def window(index: int, start: int) -> tuple[int, ...]:
        return tuple(by_file[index][start:start + prompt_tokens])

    windows = [(index, min(len(ids) - prompt_tokens, 200)) for index, ids in texts]
    # generated files (encodings/cp*.py ...) open with the same tokens: a second window that
    # repeats an earlier prompt would be the same request again, so it is left out
    seen = {window(index, start) for index, start in windows}
    for index, ids in texts:
        if len(windows) >= count:
            break
        if (len(ids) >= SECOND_WINDOW_AT + prompt_tokens
                and window(index, SECOND_WINDOW_AT) not in seen):
            seen.add(window(index, SECOND_WINDOW_AT))
            windows.append((index, SECOND_WINDOW_AT))
    windows = windows[:count]
    return ([list(window(index, start)) for index, start in windows],
            _groups([(index, window(index, start)) for index, start in windows]))


def _groups(windows: list[tuple[int, tuple[int, ...]]]) -> list[int]:
    """The group of each (file index, prompt) window: its file, files that share an identical
    prompt joined into one group (named by its first file index)."""
    parent: dict[int, int] = {}

    def root(index: int) -> int:
        while parent.get(index, index) != index:
            index = parent[index]
        return index

    first: dict[tuple[int, ...], int] = {}
    for index, prompt in windows:
        other = first.setdefault(prompt, index)
        low, high = sorted((root(index), root(other)))
        if low != high:
            parent[high] = low
    return [root(index) for index, _ in windows]


def _serve(prompts: list[list[int]], first: int, *, source: str, heads, model, new_tokens: int,
           prompt_tokens: int, batch: int) -> tuple[list, float]:
    """Records of prompts[first:] served with every token shadowed (request id = the global
    prompt index), and the decode seconds."""
    from runtime.engine import Engine, EngineConfig

    engine = Engine(model, heads=heads, config=EngineConfig(
        max_batch=batch, max_seq_len=prompt_tokens + new_tokens + 96, shadow_rate=1.0))
    started = time.perf_counter()
    for index in range(first, len(prompts)):
        engine.add_request(prompts[index], request_id=f"{source}-{index}",
                           max_new_tokens=new_tokens)
    records, done, total = [], 0, len(prompts) - first
    while engine.has_work:
        finished = sum(output.finished for output in engine.step())
        done += finished
        records += engine.drain_records()
        if finished and done % 20 < finished:
            print(f"{source}: {done}/{total} requests, {len(records)} tokens, "
                  f"{time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return records, time.perf_counter() - started


def _cached_prefix(source: str, requests: int, new_tokens: int) -> tuple[int, dict | None]:
    """The largest cached record file of this source with fewer requests: (its count, its
    arrays), or (0, None)."""
    found = []
    for path in RECORDS_DIR.glob(f"{source}-*x{new_tokens}.npz"):
        count = path.stem.split("-", 1)[1].split("x")[0]
        if count.isdigit() and int(count) < requests:
            found.append((int(count), path))
    if not found:
        return 0, None
    count, path = max(found)
    return count, load_records(path)


def produce_records(source: str, *, requests: int, new_tokens: int, prompt_tokens: int,
                    batch: int) -> Path:
    """Run the engine on one source with every token shadowed; cache the records as .npz.
    When a file of the same source with fewer requests M is cached, only prompts M.. are
    served and appended to its records (the prompt lists are prefixes of each other)."""
    path = RECORDS_DIR / f"{source}-{requests}x{new_tokens}.npz"
    if path.exists():
        return path
    import torch

    from exitplane.demo import Timeline, _heads
    from runtime.model import load_model

    torch.set_num_threads(1)  # the shared box: more threads than cores only thrash
    model, tokenizer = load_model()
    # heads are trained on first use (backward passes): no grad only once they exist
    heads, _, _ = _heads(model, tokenizer, True, Timeline())
    torch.set_grad_enabled(False)
    heads.float()
    prompts, groups = _prompts(source, tokenizer, requests, prompt_tokens,
                               trained_chars=heads.metadata["config"]["stdlib_chars"])
    if len(prompts) < requests:
        raise SystemExit(f"{source} has {len(prompts)} prompts of {prompt_tokens} tokens, "
                         f"fewer than --requests {requests}: ask for at most {len(prompts)}")
    first, cached = _cached_prefix(source, requests, new_tokens)
    layers = list(heads.exit_layers)
    if cached is not None and [int(k) for k in cached["exit_layers"]] != layers:
        raise SystemExit(f"cached {source} records have exit layers "
                         f"{cached['exit_layers'].tolist()}, the heads {layers}: remove them")
    if first:
        print(f"{source}: reusing {first} cached requests", file=sys.stderr, flush=True)
    records, decode_s = _serve(prompts, first, source=source, heads=heads, model=model,
                               new_tokens=new_tokens, prompt_tokens=prompt_tokens, batch=batch)
    new = {
        "signals": np.array([[p.signal for p in sorted(r.shadow, key=lambda p: p.layer)]
                             for r in records], dtype=np.float32),
        "matched": np.array([[p.matched for p in sorted(r.shadow, key=lambda p: p.layer)]
                             for r in records], dtype=bool),
        "request": np.array([int(r.request_id.rsplit("-", 1)[1]) for r in records]),
        "position": np.array([r.position for r in records]),
    }
    if cached is not None:
        new = {name: np.concatenate([cached[name], values]) for name, values in new.items()}
        decode_s += float(cached["decode_s"])
    RECORDS_DIR.mkdir(parents=True, exist_ok=True)
    # group: the module (chat) or file (code, docs) of each token's request; requests of one
    # group are correlated, so a split into halves keeps a group whole
    np.savez_compressed(path, **new, group=np.asarray(groups)[new["request"]],
                        exit_layers=np.array(layers), num_layers=len(model.model.layers),
                        decode_s=decode_s)
    return path


def load_records(path: Path) -> dict:
    with np.load(path) as data:
        return {name: data[name] for name in data.files}


# -- 2. traffic ------------------------------------------------------------------------------

SLOT_S = 30.0  # rollups are built per half minute so that a check every 30 s sees its minute


class Source:
    """One text source: its records split into a calibration half and a replay half."""

    def __init__(self, name: str, records: dict, *, seed: int) -> None:
        self.name = name
        self.signals, self.matched = records["signals"], records["matched"]
        self.layers = [int(k) for k in records["exit_layers"]]
        self.num_layers = int(records["num_layers"])
        request = records["request"]
        ids = np.unique(request)
        rng = np.random.default_rng(seed)
        calibration = set(rng.choice(ids, size=len(ids) // 2, replace=False).tolist())
        self.calibration = np.isin(request, list(calibration))
        # replay requests: (token indices) per request, in position order
        order = np.lexsort((records["position"], request))
        self.requests = [order[request[order] == rid] for rid in ids
                         if rid not in calibration]

    def calibrate(self, *, delta: float, epsilon: float) -> tuple[list[float], dict]:
        """Thresholds the calibrator picks on the calibration half, and their expected metrics."""
        from controlplane.calibration.learn_then_test import calibrate_thresholds
        from controlplane.calibration.service import expected_metrics

        result = calibrate_thresholds(
            signals=self.signals[self.calibration], matched=self.matched[self.calibration],
            exit_layers=self.layers, num_layers=self.num_layers, delta=delta, epsilon=epsilon,
            min_samples_per_layer=200, seed=0)
        return [result.thresholds[k] for k in self.layers], expected_metrics(result)


def traffic(sources: list[tuple[Source, float]], *, request_rate: float, token_s: float,
            shadow_rate: float, rng) -> dict:
    """Tokens of whole requests resampled from each (source, seconds) stretch in turn: arrival
    times Poisson at `request_rate`, tokens `token_s` apart inside a request."""
    parts, offset, serial = [], 0.0, 0
    for source, seconds in sources:
        count = rng.poisson(request_rate * seconds)
        arrivals = offset + np.sort(rng.random(count)) * seconds
        picks = rng.integers(0, len(source.requests), count)
        index = [source.requests[p] for p in picks]
        sizes = np.array([len(i) for i in index])
        tokens = np.concatenate(index) if count else np.zeros(0, dtype=int)
        within = np.concatenate([np.arange(n) for n in sizes]) if count else np.zeros(0)
        parts.append({"signals": source.signals[tokens], "matched": source.matched[tokens],
                      "ts": np.repeat(arrivals, sizes) + within * token_s,
                      "request": np.repeat(np.arange(serial, serial + count), sizes)})
        serial += count
        offset += seconds
    joined = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    order = np.argsort(joined["ts"], kind="stable")
    joined = {k: v[order] for k, v in joined.items()}
    joined["shadow"] = rng.random(len(joined["ts"])) < shadow_rate
    return joined


def rollup_slots(tokens: dict, thresholds: list[float], layers: list[int], num_layers: int,
                 seconds: float) -> dict:
    """Per half-minute slot what ingestion would add to the rollups: tokens reaching and
    exiting each exit layer, the signal histogram per exit layer (full depth included)."""
    from controlplane.stats.exits import policy_outcomes
    from controlplane.telemetry.models import HISTOGRAM_BINS

    slots = int(np.ceil(seconds / SLOT_S))
    slot = np.minimum((tokens["ts"] // SLOT_S).astype(int), slots - 1)
    first, _ = policy_outcomes(tokens["signals"], tokens["matched"], thresholds)
    served = np.where(tokens["shadow"], len(layers), first)  # shadow tokens go full depth
    width = len(layers) + 1
    # what `controlplane.drift.service` reads: exits and reached counts with the shadow tokens'
    # policy exits (`policy_exits`) put back, i.e. the policy's own exit of every token
    exits = np.bincount(slot * width + first, minlength=slots * width).reshape(slots, width)
    reached = np.cumsum(exits[:, ::-1], axis=1)[:, ::-1]
    # the recorded signal: at the exit, else at the deepest layer the policy checks for every
    # row (thresholds < 1); none when the policy checks nothing, except for shadow rows
    live = [j for j, t in enumerate(thresholds) if t < 1.0]
    rows = np.arange(len(first))
    if live:
        column = np.where(served < len(layers), served, live[-1])
        signal = tokens["signals"][rows, np.minimum(column, len(layers) - 1)]
        has = np.ones(len(first), dtype=bool)
    else:
        signal = tokens["signals"][:, -1]
        has = tokens["shadow"].copy()
    bins = np.minimum((signal * HISTOGRAM_BINS).astype(int), HISTOGRAM_BINS - 1)
    cell = (slot * width + served) * HISTOGRAM_BINS + bins
    histogram = np.bincount(cell[has], minlength=slots * width * HISTOGRAM_BINS).reshape(
        slots, width, HISTOGRAM_BINS)
    return {"slot": slot, "exits": exits, "reached": reached, "histogram": histogram,
            "layers": layers, "layer_keys": [*layers, num_layers]}


# -- 3. the detectors ------------------------------------------------------------------------

class Episode:
    """One version serving a stream of traffic from time 0, checked like `drift.detect`."""

    def __init__(self, tokens: dict, *, thresholds: list[float], expected: dict,
                 layers: list[int], num_layers: int, delta: float, seconds: float,
                 options) -> None:
        from datetime import UTC, datetime

        self.tokens, self.thresholds, self.expected = tokens, thresholds, expected
        self.layers, self.delta, self.options = layers, delta, options
        self.start = datetime(2026, 1, 1, tzinfo=UTC)
        self.slots = rollup_slots(tokens, thresholds, layers, num_layers, seconds)
        self.open: dict[str, dict] = {}  # dedup key -> fired_at, clear_since (reconcile)

    def _minutes(self, first_slot: int, end_slot: int):
        """[(minute, {layer: LayerCounts})] of the minutes whose slots lie before `end_slot`."""
        from datetime import timedelta

        from controlplane.drift.detectors import LayerCounts

        exits, reached = self.slots["exits"], self.slots["reached"]
        out = []
        for minute in range(first_slot // 2, (end_slot + 1) // 2):
            lo, hi = 2 * minute, min(2 * minute + 2, end_slot)
            if hi <= lo:
                continue
            counts = {layer: LayerCounts(int(reached[lo:hi, j].sum()), int(exits[lo:hi, j].sum()))
                      for j, layer in enumerate(self.layers)
                      if reached[lo:hi, j].sum() > 0}
            if counts:
                out.append((self.start + timedelta(minutes=minute), counts))
        return out

    def _histogram(self, from_minute: int, end_slot: int) -> dict[int, list[int]]:
        block = self.slots["histogram"][2 * from_minute:end_slot].sum(axis=0)
        return {key: block[j].tolist() for j, key in enumerate(self.slots["layer_keys"])
                if block[j].sum()}

    def check(self, t: float) -> tuple[list, set]:
        """The conditions `exit_behaviour_conditions` would see at `t` seconds."""
        import math
        from datetime import timedelta

        from controlplane.drift.service import expected_reference
        from controlplane.drift.window_checks import (
            WindowInputs,
            evaluate,
            lookback_start,
            reference_window,
        )

        options, layers = self.options, self.layers
        now = self.start + timedelta(seconds=t)
        end_slot = int(t // SLOT_S)
        reference = expected_reference(self.expected, layers)
        reference_until, origin = self.start, "expected_metrics"
        first = self._minutes(0, min(end_slot, int(options.reference_max_s // SLOT_S)))
        found = reference_window(first, layers, options.reference_tokens)
        if found is not None:
            reference_until = first[found[1] - 1][0] + timedelta(minutes=1)
        if reference is None and found is not None:
            reference, origin = found[0], "first_window_after_activation"
        since = lookback_start(start=self.start, reference_origin=origin,
                               reference_until=reference_until, now=now, options=options)
        since_s = (since - self.start).total_seconds()
        minutes = self._minutes(int(since_s // 60) * 2, end_slot)
        minutes = [(m, c) for m, c in minutes if m >= since]
        recent_s = max(t - options.recent_s, 0.0)
        ts, shadow = self.tokens["ts"], self.tokens["shadow"]
        lo, hi = np.searchsorted(ts, [recent_s, t])
        pick = np.flatnonzero(shadow[lo:hi]) + lo
        histograms = None
        if found is not None:
            until_minute = int((reference_until - self.start).total_seconds() // 60)
            recent_minute = max(math.ceil(recent_s / 60), until_minute)
            histograms = (self._histogram(0, 2 * until_minute),
                          self._histogram(recent_minute, end_slot))
        info = self.open.get("distribution_drift:all")
        inputs = WindowInputs(
            version=2, layers=layers, thresholds=self.thresholds, delta=self.delta, now=now,
            reference=reference, reference_origin=origin,
            reference_window=(self.start, reference_until) if found is not None else None,
            since=since, minutes=minutes, recent_since=self.start + timedelta(seconds=recent_s),
            shadow_requests=self.tokens["request"][pick].astype(str),
            shadow_signals=self.tokens["signals"][pick],
            shadow_matched=self.tokens["matched"][pick],
            shadow_times=self.start.timestamp() + ts[pick],
            histograms=histograms,
            info_open=(info["fired"], info["clear_since"]) if info else None)
        return evaluate(inputs, options)

    def true_disagreement(self, t: float, seconds: float | None = None) -> float:
        """Disagreement of every token (not only shadow ones) of the last `seconds` (default:
        the recent window)."""
        from controlplane.stats.exits import policy_outcomes

        seconds = self.options.recent_s if seconds is None else seconds
        lo, hi = np.searchsorted(self.tokens["ts"], [max(t - seconds, 0), t])
        if hi <= lo:
            return 0.0
        _, disagree = policy_outcomes(self.tokens["signals"][lo:hi],
                                      self.tokens["matched"][lo:hi], self.thresholds)
        return float(disagree.mean())

    def reconcile(self, t: float, conditions: list, checked: set) -> list[dict]:
        """Open / refresh / clear alerts as `alerts.service.reconcile`; the newly fired ones,
        with the fallback decision of the quality-at-risk kinds."""
        from datetime import timedelta
        from types import SimpleNamespace

        from controlplane.alerts.kinds import QUALITY_AT_RISK
        from controlplane.flows.fallback import SpikeGate, decide
        from controlplane.settings import get_settings

        now = self.start + timedelta(seconds=t)
        fired, seen = [], set()
        for condition in conditions:
            key = f"{condition.kind}:{condition.subject}"
            seen.add(key)
            if key in self.open:
                self.open[key]["clear_since"] = None
                continue
            self.open[key] = {"fired": now, "clear_since": None, "kind": condition.kind}
            event = {"t": t, "kind": condition.kind, "severity": condition.severity,
                     "layer": condition.layer, "fallback": None, "summary": condition.summary}
            if condition.kind in QUALITY_AT_RISK:
                decision = decide(alert=SimpleNamespace(kind=condition.kind,
                                                        evidence=condition.evidence),
                                  delta=self.delta,
                                  gate=SpikeGate.from_settings(get_settings()))
                event["fallback"] = decision.fall_back
                event["rule"] = decision.rule
                window = (condition.evidence.get("evidence") or {}).get("window") or {}
                event["window_s"] = window.get("seconds", self.options.recent_s)
                event["true_disagreement"] = self.true_disagreement(t, event["window_s"])
                event["true_disagreement_recent"] = self.true_disagreement(t)
            fired.append(event)
        for key, alert in list(self.open.items()):
            if key in seen or alert["kind"] not in checked:
                continue
            alert["clear_since"] = alert["clear_since"] or now
            if (now - alert["clear_since"]).total_seconds() >= self.options.clear_after_s:
                del self.open[key]
        return fired

    def run(self, times) -> list[dict]:
        events = []
        for t in map(float, times):
            conditions, checked = self.check(t)
            events += self.reconcile(t, conditions, checked)
        return events


# -- 4. the benchmark ------------------------------------------------------------------------

def conditional_rates(source: Source, thresholds: list[float]) -> tuple[np.ndarray, float]:
    """Conditional exit rate per layer and disagreement of a source's replay half."""
    from controlplane.stats.exits import policy_outcomes

    tokens = np.concatenate(source.requests)
    first, disagree = policy_outcomes(source.signals[tokens], source.matched[tokens],
                                      thresholds)
    exits = np.bincount(first, minlength=len(thresholds) + 1)[:len(thresholds)]
    reached = len(first) - np.concatenate([[0], np.cumsum(exits)[:-1]])
    return exits / np.maximum(reached, 1), float(disagree.mean())


def _pages(events: list[dict]) -> list[dict]:
    return [e for e in events if e["severity"] in ("warning", "critical")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=120, help="requests per source")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--records-only", action="store_true")
    parser.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES),
                        help="with --records-only: produce these sources' records only")
    parser.add_argument("--hours", type=float, default=24.0,
                        help="stationary hours in all, split across the sources")
    parser.add_argument("--switches", type=int, default=2, help="switches per ordered pair")
    parser.add_argument("--warmup-min", type=float, default=30.0)
    parser.add_argument("--after-min", type=float, default=20.0)
    parser.add_argument("--token-rate", type=float, default=300.0,
                        help="tokens per second of the deployment (module docstring)")
    parser.add_argument("--token-s", type=float, default=0.05, help="decode time per token")
    parser.add_argument("--shadow-rate", type=float, default=0.3)
    parser.add_argument("--delta", type=float, default=0.05)
    parser.add_argument("--epsilon", type=float, default=0.1)
    parser.add_argument("--check-every-s", type=float, default=30.0,
                        help="check period in stationary stretches (each check replays the "
                             "whole lookback, as the task does)")
    parser.add_argument("--episode-hours", type=float, default=2.0,
                        help="longest stationary episode (a fresh activation each)")
    parser.add_argument("--shift-check-every-s", type=float, default=30.0,
                        help="check period after a switch (the drift beat's 30 s)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print("command:", " ".join([sys.executable, *sys.argv]), flush=True)
    paths = {name: produce_records(name, requests=args.requests, new_tokens=args.new_tokens,
                                   prompt_tokens=args.prompt_tokens, batch=args.batch)
             for name in (args.sources if args.records_only else SOURCES)}
    if args.records_only:
        print(json.dumps({name: str(path) for name, path in paths.items()}))
        return

    from controlplane.drift.window_checks import DriftOptions
    from controlplane.settings import get_settings

    started = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    options = DriftOptions.from_settings(get_settings())  # what `drift.detect` runs with
    sources = {name: Source(name, load_records(path), seed=args.seed)
               for name, path in paths.items()}
    calibrated = {name: source.calibrate(delta=args.delta, epsilon=args.epsilon)
                  for name, source in sources.items()}
    mean_len = np.mean([len(r) for s in sources.values() for r in s.requests])
    request_rate = args.token_rate / mean_len
    for name, (thresholds, _expected) in calibrated.items():
        rates, disagreement = conditional_rates(sources[name], thresholds)
        print(f"{name}: {len(sources[name].requests)} replay requests; thresholds "
              f"{[round(t, 3) for t in thresholds]}; replay disagreement {disagreement:.3f}; "
              f"exit rates {rates.round(3).tolist()}", flush=True)

    def episode(stretches, thresholds, expected, times):
        seconds = sum(s for _, s in stretches)
        tokens = traffic(stretches, request_rate=request_rate, token_s=args.token_s,
                         shadow_rate=args.shadow_rate, rng=rng)
        first = next(iter(sources.values()))
        run = Episode(tokens, thresholds=thresholds, expected=expected, layers=first.layers,
                      num_layers=first.num_layers, delta=args.delta, seconds=seconds,
                      options=options)
        return run.run(times)

    stationary_s, false_alarms, false_fallbacks, fallbacks, infos = 0.0, [], 0, 0, 0
    diluted = 0
    per_source = args.hours * 3600 / len(sources)
    for name, source in sources.items():
        thresholds, expected = calibrated[name]
        events, left = [], per_source
        while left > 1e-9:
            seconds = min(left, args.episode_hours * 3600)
            times = np.arange(args.check_every_s, seconds + 1e-9, args.check_every_s)
            events += episode([(source, seconds)], thresholds, expected, times)
            left -= seconds
        stationary_s += per_source
        false_alarms += [dict(e, source=name) for e in _pages(events)]
        infos += sum(e["severity"] == "info" for e in events)
        print(f"stationary {name}: {per_source / 3600:.1f} h, {len(_pages(events))} alerts "
              f"({time.perf_counter() - started:.0f} s)", flush=True)
        for event in events:
            if event["fallback"]:
                fallbacks += 1
                false_fallbacks += event["true_disagreement"] <= args.delta
                diluted += event["true_disagreement_recent"] <= args.delta

    warmup, after = args.warmup_min * 60, args.after_min * 60
    delays, missed, shifts, skipped = [], [], [], 0
    for home, target in [(a, b) for a in sources for b in sources if a != b]:
        thresholds, expected = calibrated[home]
        home_rates, _ = conditional_rates(sources[home], thresholds)
        target_rates, target_disagreement = conditional_rates(sources[target], thresholds)
        moves = (target_disagreement > args.delta
                 or np.abs(target_rates - home_rates).max() >= options_min_effect())
        for _ in range(args.switches):
            times = np.concatenate([
                np.arange(args.check_every_s, warmup + 1e-9, args.check_every_s),
                np.arange(warmup + args.shift_check_every_s, warmup + after + 1e-9,
                          args.shift_check_every_s)])
            events = episode([(sources[home], warmup), (sources[target], after)], thresholds,
                             expected, times)
            stationary_s += warmup
            before = [e for e in _pages(events) if e["t"] <= warmup]
            false_alarms += [dict(e, source=home) for e in before]
            infos += sum(e["severity"] == "info" for e in events)
            for event in events:
                if event["fallback"]:
                    fallbacks += 1
                    false_fallbacks += event["true_disagreement"] <= args.delta
                    diluted += event["true_disagreement_recent"] <= args.delta
                    print("fallback", json.dumps({k: event[k] for k in (
                        "t", "kind", "rule", "window_s", "true_disagreement",
                        "true_disagreement_recent")} | {"from": home, "to": target}))
            detected = [e for e in _pages(events) if e["t"] > warmup]
            shift = {"from": home, "to": target, "moves": bool(moves),
                     "target_disagreement": round(target_disagreement, 4),
                     "max_rate_change": round(float(np.abs(target_rates - home_rates).max()),
                                              3),
                     "detected_s": detected[0]["t"] - warmup if detected else None,
                     "first_alert": detected[0]["kind"] if detected else None}
            shifts.append(shift)
            if not moves:
                skipped += 1
            elif detected:
                delays.append(shift["detected_s"])
            else:
                missed.append(shift)
        print(f"switch {home} -> {target}: {[s['detected_s'] for s in shifts[-args.switches:]]}"
              f" ({time.perf_counter() - started:.0f} s)", flush=True)

    hours = (stationary_s + len(shifts) * after) / 3600
    for shift in shifts:
        print("shift", json.dumps(shift))
    for alarm in false_alarms:
        print("false alarm", json.dumps({k: alarm[k] for k in ("source", "t", "kind", "layer",
                                                               "severity", "summary")}))
    print(json.dumps({
        "false_alarms_per_hour": round(len(false_alarms) / (stationary_s / 3600), 4),
        "false_fallbacks": int(false_fallbacks),
        "shift_detect_s_median": float(np.median(delays)) if delays else None,
        "missed_shifts": len(missed),
        "hours": round(hours, 2),
        "stationary_hours": round(stationary_s / 3600, 2),
        "shifts": len(shifts) - skipped, "shifts_without_change": skipped,
        "fallbacks": fallbacks, "fallbacks_recent_window_within_delta": int(diluted),
        "info_findings": infos,
        "token_rate": args.token_rate, "shadow_rate": args.shadow_rate, "delta": args.delta,
        "check_every_s": args.check_every_s, "shift_check_every_s": args.shift_check_every_s,
        "first_alerts": {kind: sum(s["first_alert"] == kind for s in shifts)
                         for kind in sorted({s["first_alert"] for s in shifts} - {None})},
        "records": {name: len(s.signals) for name, s in sources.items()},
        "seconds": round(time.perf_counter() - started, 1)}))


def options_min_effect() -> float:
    """The exit-rate detectors' minimum effect (a smaller change is not a shift to detect)."""
    import inspect

    from controlplane.drift.detectors import ExitRateMonitor

    return inspect.signature(ExitRateMonitor).parameters["min_effect"].default


if __name__ == "__main__":
    main()
