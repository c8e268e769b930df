"""Per-segment thresholds against one pooled set when the traffic mix moves.

Real shadow samples of SmolLM2-135M-Instruct served by the runtime engine with every token
shadowed at every exit layer, `chat` and `code`, produced once by bench/drift_real.py
(`produce_records`; read here with its `load_records`) under var/drift_real/. Nothing here
regenerates them.

Each of `--trials` resamples works on whole requests (a request's tokens are correlated, so
they are never split):

1. each source's requests are split at random into a calibration half and a serving half;
2. calibration mix `--calibrate-mix` chat (0.8): every calibration request of the majority
   source and a random subset of the other's, so that the mix holds by requests; serving mix
   `--serve-mix` chat (0.2) built the same way from the serving halves;
3. on the calibration mix: one pooled set (fixed-sequence Learn-Then-Test at ε, what the
   calibrator publishes today) and per-segment sets (`calibrate_segments`: ε split across the
   segments; a segment too small or with nothing certified keeps the pooled set if its own
   check tokens certify it, else never-exit);
4. `pooled_recalibrated`: a pooled set calibrated the same way on a calibration mix with the
   *serving* proportions (from the calibration halves): the best one set can do after the
   incident and its recalibration;
5. every set is replayed on the serving mix (each token under its segment's thresholds).

Reported (one JSON line, last): `pooled_violation_rate` / `segment_violation_rate` (share of
trials whose served disagreement exceeds δ), `segment_exit_rate`, `pooled_exit_rate` and
`pooled_recalibrated_exit_rate` (mean exit rates on the served mix), `epsilon`, `trials`, and
per-segment figures: served exit rates and disagreement, `served_violation_rate` (the segment
served alone: its share of trials above δ), `serving_half_violation_rate` (its set on every
request of its serving half, a closer reading of its true risk), which set each segment got,
sample sizes. Every calibrator gets the mix's request ids (`--independent-tokens` hides them).

How the calibrator spends a small segment's data: its own Learn-Then-Test runs per request at
its share of ε (Šidák across the segments' own tests); a segment large enough for its own test
keeps no pooled-check reserve (`--pooled-check-share` adds one) and gets never-exit when that
test certifies nothing; a small segment's threshold path borrows the larger segments' tokens
(`--own-path-only` draws it from its own). What limits the per-segment exit rate is the small
segment's own test on few requests, so the ratio grows with calibration data.

The records carry a `group` (a module asked about again, a second window of one file, files
whose prompts are identical) and the halves are split by group (`split_halves`; files without
one, the 120 and 480 ones, by request). `--first-of 960` reads the first N requests of the 960
files with their groups. Figures (2026-12-01, loaded 2-core box): defaults, 100 trials, δ 0.05,
ε 0.1; "cl": `--cluster-by-group` (the calibrators get group ids as request ids); requests in
the 80/20 calibration mix, chat / code, and in the recalibrated pool (all of code's calibration
half, a quarter as many chat):

requests    split seed  cal. mix  pool  violation: pooled seg.  recal.  exit: seg.  recal.  ratio
120         req.  0    60 / 15   75                 0.44  0.02   0.13      0.1583  0.2355  0.672
120 of 960  group 0    60 / 15   75                 0.47  0.01   0.07      0.1582  0.2366  0.668
480         req.  0    240 / 60  300                0.79  0.02   0.06      0.2165  0.2408  0.899
480         req.  1                                 0.80  0.01   0.10      0.2203  0.2414  0.913
480         req.  2                                 0.77  0.05   0.05      0.2209  0.2400  0.920
480 of 960  group 0    240 / 60  ~300               0.80  0.07   0.21      0.2222  0.2415  0.920
480 of 960  group 1                                 0.73  0.00   0.10      0.2160  0.2387  0.905
480 of 960  group 2                                 0.75  0.05   0.06      0.2166  0.2390  0.906
480 of 960  cl    0                                 0.80  0.03   0.14      0.2197  0.2392  0.918
720         group 0    360 / 90  ~450               0.90  0.02   0.12      0.2267  0.2448  0.926
720         group 1                                 0.97  0.02   0.13      0.2263  0.2462  0.919
960         group 0    480 / 120 ~600               0.95  0.01   0.10      0.2324  0.2505  0.928
960         group 1                                 0.98  0.05   0.14      0.2369  0.2521  0.940
960         group 2                                 0.98  0.02   0.10      0.2328  0.2494  0.934
960         cl    0                                 0.94  0.03   0.06      0.2329  0.2495  0.934

The curve: 0.67x at 120 requests per source, 0.90-0.92x at 480 (the 0.899x above is seed 0's
draw; three seeds average 0.911x by request, 0.910x by group: the group split changes nothing
beyond the noise), 0.92-0.93x at 720, 0.93-0.94x at 960 (every seed above 0.9x by 0.028 or
more): the target is met at 960 requests per source (120 code requests in the calibration mix),
and at 480 it sits on the target within the seed noise (±0.01). The per-segment sets hold ε at
every size (0.00-0.07) while the pooled set breaks δ more often as data grows (0.44 ->
0.95-0.98: its chat-heavy calibration certifies more exits, 0.257 -> 0.282, which code does not
bear). Per segment at 960 (seed 0): code exits 0.240 (0.221 at 480), chat 0.201 (0.199), served
alone above δ in 0.02 (code) and 0.11 (chat) of trials, serving half 0.02 / 0.04; chat served
alone (a quarter of code's served requests) reads 0.08-0.17 across these runs, its serving half
0.03-0.09. The reference is not safe either: the recalibrated pool exceeds δ in 0.06-0.21 of
trials with the group split (0.05-0.13 by request), in part since every calibrator tests per
request while a module's or file's requests are more alike than independent ones: given the
groups as clusters (cl) it reads 0.06 at 960 (0.10 without) and 0.14 at 480 (0.21), and the
ratio holds (0.934x, 0.918x). 170-230 s per run at 480, 300-380 s at 960 (loaded 2-core box).

    .venv/bin/python -P bench/segments.py
    .venv/bin/python -P bench/segments.py --trials 100 --delta 0.05 --epsilon 0.1
    # 480 requests per source (records: bench/drift_real.py --records-only --requests 480,
    # about 20 minutes per source on a loaded 2-core box)
    .venv/bin/python -P bench/segments.py --requests 480
    .venv/bin/python -P bench/segments.py --requests 480 --own-path-only  # no borrowed path
    .venv/bin/python -P bench/segments.py --requests 480 --pooled-check-share 0.1  # a reserve
    # 960 requests per source (bench/drift_real.py --records-only --sources chat code
    # --requests 960: on top of the 480 files, ~10 minutes per source); the curve on one set
    .venv/bin/python -P bench/segments.py --requests 960 [--seed 1|2] [--cluster-by-group]
    .venv/bin/python -P bench/segments.py --requests 720
    .venv/bin/python -P bench/segments.py --requests 480 --first-of 960  # 120 likewise
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from controlplane.calibration.learn_then_test import (
    MATCH_MODELS,
    TESTS,
    NotEnoughShadowData,
    calibrate_thresholds,
)
from controlplane.calibration.segments import calibrate_segments
from controlplane.stats.exits import policy_outcomes

SEGMENTS = ("chat", "code")


def _drift_real():
    """bench/drift_real.py as a module (bench/ is not a package; its runtime.py would shadow
    the runtime package on sys.path), for its record reader and paths."""
    path = Path(__file__).resolve().parent / "drift_real.py"
    spec = importlib.util.spec_from_file_location("bench_drift_real", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def request_groups(records: dict) -> list[np.ndarray]:
    """Token indices of each request, in position order."""
    request = records["request"]
    order = np.lexsort((records["position"], request))
    sorted_ids = request[order]
    cuts = np.flatnonzero(np.diff(sorted_ids)) + 1
    return np.split(order, cuts)


def split_halves(records: dict, requests: list[np.ndarray], share: float,
                 rng: np.random.Generator) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """A random calibration / serving split of one source's requests (`request_groups`),
    `share` of them for calibration. Records with a `group` array (the module or file a
    request's prompt came from, files with an identical prompt joined: bench/drift_real.py)
    are split by group, so that correlated requests never land in both halves; without one,
    by request."""
    if "group" not in records:
        order = rng.permutation(len(requests))
        cut = round(len(order) * share)
        return [requests[i] for i in order[:cut]], [requests[i] for i in order[cut:]]
    of_request = np.array([records["group"][tokens[0]] for tokens in requests])
    names, unit = np.unique(of_request, return_inverse=True)
    order = rng.permutation(len(names))
    cut = round(len(order) * share)
    members = [np.flatnonzero(unit == u) for u in range(len(names))]
    return ([requests[i] for u in order[:cut] for i in members[u]],
            [requests[i] for u in order[cut:] for i in members[u]])


def first_requests(records: dict, count: int) -> dict:
    """The records of requests 0..count-1 (the prompt lists are prefixes of each other, so
    these are what a `count`-request file holds, with the larger file's groups)."""
    keep = records["request"] < count
    per_token = {"signals", "matched", "request", "position", "group"}
    return {name: values[keep] if name in per_token else values
            for name, values in records.items()}


def _mix(pools: dict[str, list[np.ndarray]], chat_share: float,
         rng: np.random.Generator) -> dict[str, list[np.ndarray]]:
    """Requests of each segment so that `chat_share` of the requests are chat: all of the
    majority segment's pool, a random subset of the other's (without replacement)."""
    shares = {"chat": chat_share, "code": 1.0 - chat_share}
    major = max(shares, key=shares.get)
    minor = "code" if major == "chat" else "chat"
    count = min(len(pools[minor]), round(len(pools[major]) * shares[minor] / shares[major]))
    chosen = rng.choice(len(pools[minor]), size=count, replace=False)
    return {major: list(pools[major]), minor: [pools[minor][i] for i in sorted(chosen)]}


def _stack(records: dict[str, dict], mix: dict[str, list[np.ndarray]]):
    """(signals, matched, segment labels, request ids, group ids) of the mix's tokens (a
    request's group: its records' `group`, else the request itself)."""
    signals, matched, labels, requests, groups = [], [], [], [], []
    next_id, group_ids = 0, {}
    for name in SEGMENTS:
        for tokens in mix.get(name, []):
            signals.append(records[name]["signals"][tokens])
            matched.append(records[name]["matched"][tokens])
            labels += [name] * len(tokens)
            requests += [next_id] * len(tokens)
            key = (name, int(records[name]["group"][tokens[0]]) if "group" in records[name]
                   else -1 - next_id)
            groups += [group_ids.setdefault(key, len(group_ids))] * len(tokens)
            next_id += 1
    return (np.vstack(signals).astype(float), np.vstack(matched).astype(bool),
            np.array(labels), np.array(requests), np.array(groups))


def _replay(signals, matched, labels, by_segment: dict[str, list[float]]):
    """Exit and disagreement flags per served token, each under its segment's thresholds."""
    exits = np.zeros(len(signals), dtype=bool)
    wrong = np.zeros(len(signals), dtype=bool)
    for name, thresholds in by_segment.items():
        mine = labels == name
        first, disagree = policy_outcomes(signals[mine], matched[mine], thresholds)
        exits[mine] = first < signals.shape[1]
        wrong[mine] = disagree
    return exits, wrong


def _ids(stacked, by_request: bool, by_group: bool = False):
    """The stacked mix's request ids for the calibrators (their group ids with `by_group`),
    or None to hide them."""
    if by_group:
        return stacked[4]
    return stacked[3] if by_request else None


def _pooled(signals, matched, requests, *, layers, num_layers, delta, epsilon, min_samples,
            seed, method):
    try:
        result = calibrate_thresholds(signals=signals, matched=matched, requests=requests,
                                      exit_layers=layers,
                                      num_layers=num_layers, delta=delta, epsilon=epsilon,
                                      min_samples_per_layer=min_samples, seed=seed,
                                      risk_test=method["risk_test"],
                                      match_model=method["match_model"])
    except NotEnoughShadowData:
        return [1.0] * len(layers)
    return [result.thresholds[k] for k in layers]


def run_trials(records: dict[str, dict], *, trials: int, delta: float, epsilon: float,
               calibrate_mix: float = 0.8, serve_mix: float = 0.2, split: float = 0.5,
               min_samples: int = 200, seed: int = 0, risk_test: str = "binomial",
               match_model: str = "logistic", pooled_check_share: float = 0.0,
               by_request: bool = True, borrow_path: bool = True,
               by_group: bool = False) -> dict:
    """The benchmark on loaded records ({"chat": ..., "code": ...}); see the module docstring.
    `risk_test`, `match_model` and `pooled_check_share` are the calibrators' options (their
    product defaults), there to measure what each costs; every set uses the same ones.
    `by_request` False hides the request ids from every calibrator (tokens then count as
    independent draws, the calibrator before request-level tests). `borrow_path` False draws
    each segment's path from its own learn tokens only (the calibrator before it borrowed).
    `by_group` gives the calibrators group ids as request ids: requests of one module or file
    then count as one cluster (ablation: the records' correlation beyond a request)."""
    method = dict(risk_test=risk_test, match_model=match_model)
    layers = [int(k) for k in records["chat"]["exit_layers"]]
    num_layers = int(records["chat"]["num_layers"])
    if [int(k) for k in records["code"]["exit_layers"]] != layers:
        raise ValueError("chat and code records have different exit layers")
    groups = {name: request_groups(records[name]) for name in SEGMENTS}
    rng = np.random.default_rng(seed)
    options = dict(layers=layers, num_layers=num_layers, delta=delta, epsilon=epsilon,
                   min_samples=min_samples, method=method)
    served_disagreement = {"pooled": [], "segment": [], "recalibrated": []}
    served_exit = {"pooled": [], "segment": [], "recalibrated": []}
    per_segment = {name: {"exit": [], "disagreement": [], "calibration_tokens": [],
                          "served_tokens": [], "sources": Counter(), "half": []}
                   for name in SEGMENTS}
    for trial in range(trials):
        calibration, serving = {}, {}
        for name in SEGMENTS:
            calibration[name], serving[name] = split_halves(records[name], groups[name], split,
                                                            rng)
        cal = _stack(records, _mix(calibration, calibrate_mix, rng))
        served = _stack(records, _mix(serving, serve_mix, rng))
        after = _stack(records, _mix(calibration, serve_mix, rng))

        ids = _ids(cal, by_request, by_group)
        pooled = _pooled(cal[0], cal[1], ids, seed=trial, **options)
        segmented = calibrate_segments(
            signals=cal[0], matched=cal[1], segments=cal[2], requests=ids,
            exit_layers=layers, num_layers=num_layers, delta=delta, epsilon=epsilon,
            min_samples_per_layer=min_samples, seed=trial,
            pooled_check_share=pooled_check_share, borrow_path=borrow_path, **method)
        recalibrated = _pooled(after[0], after[1], _ids(after, by_request, by_group), seed=trial,
                               **options)

        sets = {
            "pooled": dict.fromkeys(SEGMENTS, pooled),
            "segment": {name: [segmented.segments[name].thresholds[k] for k in layers]
                        for name in SEGMENTS},
            "recalibrated": dict.fromkeys(SEGMENTS, recalibrated),
        }
        for kind, by_segment in sets.items():
            exits, wrong = _replay(served[0], served[1], served[2], by_segment)
            served_disagreement[kind].append(float(wrong.mean()))
            served_exit[kind].append(float(exits.mean()))
            if kind == "segment":
                for name in SEGMENTS:
                    mine = served[2] == name
                    stats = per_segment[name]
                    stats["exit"].append(float(exits[mine].mean()))
                    stats["disagreement"].append(float(wrong[mine].mean()))
                    stats["served_tokens"].append(int(mine.sum()))
                    stats["calibration_tokens"].append(int((cal[2] == name).sum()))
                    stats["sources"][segmented.segments[name].source] += 1
                    # the segment's set on *every* request of its serving half (~240): a
                    # closer reading of its true risk than the served mix's share of them
                    half = _stack(records, {name: serving[name]})
                    wrong_half = _replay(half[0], half[1], half[2],
                                         {name: by_segment[name]})[1]
                    stats["half"].append(float(wrong_half.mean()))

    def violation_rate(kind: str) -> float:
        return float(np.mean(np.array(served_disagreement[kind]) > delta))

    return {
        "pooled_violation_rate": violation_rate("pooled"),
        "segment_violation_rate": violation_rate("segment"),
        "segment_exit_rate": float(np.mean(served_exit["segment"])),
        "pooled_recalibrated_exit_rate": float(np.mean(served_exit["recalibrated"])),
        "epsilon": epsilon,
        "trials": trials,
        "delta": delta,
        "pooled_exit_rate": float(np.mean(served_exit["pooled"])),
        "pooled_recalibrated_violation_rate": violation_rate("recalibrated"),
        "served_disagreement_mean": {kind: float(np.mean(values))
                                     for kind, values in served_disagreement.items()},
        "segments": {name: {
            "served_exit_rate": float(np.mean(stats["exit"])),
            "served_disagreement_mean": float(np.mean(stats["disagreement"])),
            "served_violation_rate": float(np.mean(np.array(stats["disagreement"]) > delta)),
            "serving_half_violation_rate": float(np.mean(np.array(stats["half"]) > delta)),
            "serving_half_disagreement_mean": float(np.mean(stats["half"])),
            "calibration_tokens_mean": float(np.mean(stats["calibration_tokens"])),
            "served_tokens_mean": float(np.mean(stats["served_tokens"])),
            "thresholds_from": dict(stats["sources"]),
        } for name, stats in per_segment.items()},
        "requests_per_source": {name: len(groups[name]) for name in SEGMENTS},
        "split_by": {name: "group" if "group" in records[name] else "request"
                     for name in SEGMENTS},
        "groups_per_source": {name: len(np.unique(records[name]["group"]))
                              if "group" in records[name] else len(groups[name])
                              for name in SEGMENTS},
        "tokens_per_source": {name: len(records[name]["signals"]) for name in SEGMENTS},
        "calibrate_mix_chat": calibrate_mix,
        "serve_mix_chat": serve_mix,
        "min_samples_per_layer": min_samples,
        "risk_test": risk_test,
        "match_model": match_model,
        "pooled_check_share": pooled_check_share,
        "risk_unit": "request" if by_request else "token",
        "borrow_path": borrow_path,
        "cluster_by_group": by_group,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records-dir", type=Path, default=None,
                        help="default: bench/drift_real.py's RECORDS_DIR (var/drift_real)")
    parser.add_argument("--requests", type=int, default=120, help="requests per source file")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--first-of", type=int, default=None, metavar="M",
                        help="read the first --requests requests of the M-request files (with "
                             "their groups): the curve over sizes on one set of records")
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--delta", type=float, default=0.05)
    parser.add_argument("--epsilon", type=float, default=0.1)
    parser.add_argument("--calibrate-mix", type=float, default=0.8, help="chat share")
    parser.add_argument("--serve-mix", type=float, default=0.2, help="chat share")
    parser.add_argument("--split", type=float, default=0.5,
                        help="share of each source's requests used for calibration")
    parser.add_argument("--min-samples", type=int, default=200,
                        help="fewest shadow tokens per layer for a Learn-Then-Test run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--risk-test", choices=TESTS, default="binomial",
                        help="Learn-Then-Test p-value (ablation; the product default)")
    parser.add_argument("--match-model", choices=MATCH_MODELS, default="logistic",
                        help="the path's P(match) model (ablation; the product default)")
    parser.add_argument("--pooled-check-share", type=float, default=0.0,
                        help="share of a segment's ε/k for the pooled-set fallback (ablation: "
                             "> 0 is the Bonferroni split with a reserve, main before "
                             "seg-power2; 0.1 was its default)")
    parser.add_argument("--independent-tokens", action="store_true",
                        help="hide request ids from the calibrators (ablation: the token-level "
                             "test they used before)")
    parser.add_argument("--own-path-only", action="store_true",
                        help="each segment's path from its own learn tokens only (ablation: "
                             "the calibrator before it borrowed the other segments')")
    parser.add_argument("--cluster-by-group", action="store_true",
                        help="give the calibrators each request's group (module or file) as "
                             "its id, so a group counts as one cluster (ablation)")
    args = parser.parse_args()
    print("command:", " ".join([sys.executable, *sys.argv]), flush=True)
    drift_real = _drift_real()
    folder = args.records_dir or drift_real.RECORDS_DIR
    if args.first_of is not None and args.first_of < args.requests:
        print(f"--first-of {args.first_of} is below --requests {args.requests}: give the larger "
              f"file's size", file=sys.stderr)
        return 2
    records = {}
    for name in SEGMENTS:
        size = args.first_of or args.requests
        path = folder / f"{name}-{size}x{args.new_tokens}.npz"
        if not path.exists():
            print(f"missing {path}: produce the records with "
                  f"`.venv/bin/python -P bench/drift_real.py --records-only`", file=sys.stderr)
            return 2
        records[name] = first_requests(drift_real.load_records(path), args.requests)
    started = time.perf_counter()
    report = run_trials(records, trials=args.trials, delta=args.delta, epsilon=args.epsilon,
                        calibrate_mix=args.calibrate_mix, serve_mix=args.serve_mix,
                        split=args.split, min_samples=args.min_samples, seed=args.seed,
                        risk_test=args.risk_test, match_model=args.match_model,
                        pooled_check_share=args.pooled_check_share,
                        by_request=not args.independent_tokens,
                        borrow_path=not args.own_path_only,
                        by_group=args.cluster_by_group)
    report["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
