"""Which drift can the segments story (`exitplane demo --story segments`) close on? Offline, on
the real model's shadow records.

(`-P`: bench/runtime.py must not shadow the `runtime` package.)

1. Records, produced once and cached under var/drift_real/ (`demo-<source>-48.npz`): the engine
   (SmolLM2-135M-Instruct with the exit heads the demo caches under var/runtime/) serves each
   prompt source of the story once, 48 new tokens per request, every token shadowed at every
   exit layer, greedy under the never-exit set (the full model's own text):
   `chat` (the 80 chat prompts, chat template), `code` (80 code-assistant requests,
   `corpus.code_requests`, chat template; the story serves the first 64), `pasted` (the 16
   raw stdlib sources the default story shifts to) and `manifests` (the same files' block-
   checksum manifests, 32 requests, `corpus.checksum_manifests`, raw: what the story's code segment
   drifts to; the figures in README's demo row were taken when half of them were the files
   base64-encoded).

These records are the full model's own text; served, a drift is milder (in a real run the
checksum manifests' shadow disagreement under code's map was 5.4%, base64 text's 4.2%, not the
8.5-15% seen here), so read the figures as an upper bound of what the workers will see.
2. The story's calibration, replayed `--seeds` times on the first `--requests` requests of chat
   and of code: `calibrate_segments` (δ 0.05, ε 0.1 split across the two segments, 300 samples
   per layer, learn fraction 0.5: the demo's settings). For each segment's map: exit rate and
   disagreement on its own source and on each drift candidate; then a recalibration
   (`calibrate_thresholds` at ε/2, one segment's share) on the manifests alone.

Prints the command and one JSON line: per seed the rows above, and the ranges over seeds.

    .venv/bin/python -P bench/demo_segments.py              # records cached after the first run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import numpy as np

RECORDS_DIR = Path("var/drift_real")
NEW_TOKENS = 48
SOURCES = ("chat", "code", "pasted", "manifests")
DELTA, EPSILON, MIN_SAMPLES, LEARN_FRACTION = 0.05, 0.1, 300, 0.5  # `exitplane demo --quick`


def _prompts(tokenizer) -> dict[str, list[list[int]]]:
    from exitplane.demo import CODE_FILES, _code_prompts
    from exitplane.demo_segments import prompt_sources
    from runtime import corpus

    chat, _, manifests = prompt_sources(tokenizer, corpus)
    code = [corpus.chat_prompt_ids(tokenizer, p)
            for p in corpus.code_requests(80, skip=CODE_FILES)]
    return {"chat": chat, "code": code, "pasted": _code_prompts(tokenizer, 16),
            "manifests": manifests}


def produce_records() -> None:
    """Shadow records of every source (module docstring), each cached as .npz."""
    missing = [s for s in SOURCES if not (RECORDS_DIR / f"demo-{s}-{NEW_TOKENS}.npz").exists()]
    if not missing:
        return
    import torch

    from exitplane.demo import Timeline, _heads
    from runtime.engine import Engine, EngineConfig
    from runtime.model import load_model

    torch.set_num_threads(1)  # the shared box: more threads than cores only thrash
    model, tokenizer = load_model()
    with contextlib.redirect_stdout(sys.stderr):  # its timeline line; stdout is the result
        heads, _, _ = _heads(model, tokenizer, True, Timeline())
    torch.set_grad_enabled(False)
    heads.float()
    prompts = _prompts(tokenizer)
    RECORDS_DIR.mkdir(parents=True, exist_ok=True)
    for source in missing:
        engine = Engine(model, heads=heads, config=EngineConfig(
            max_batch=16, max_seq_len=256, shadow_rate=1.0))
        for index, prompt in enumerate(prompts[source]):
            engine.add_request(prompt, request_id=f"{source}-{index}",
                               max_new_tokens=NEW_TOKENS)
        started, records = time.perf_counter(), []
        while engine.has_work:
            engine.step()
            records += engine.drain_records()
        points = [sorted(r.shadow, key=lambda p: p.layer) for r in records]
        np.savez_compressed(
            RECORDS_DIR / f"demo-{source}-{NEW_TOKENS}.npz",
            signals=np.array([[p.signal for p in row] for row in points], dtype=np.float32),
            matched=np.array([[p.matched for p in row] for row in points], dtype=bool),
            request=np.array([int(r.request_id.rsplit("-", 1)[1]) for r in records]),
            position=np.array([r.position for r in records]),
            exit_layers=np.array(list(heads.exit_layers)), num_layers=len(model.model.layers))
        print(f"{source}: {len(prompts[source])} requests, {len(records)} tokens, "
              f"{time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)


def _load(source: str) -> dict:
    with np.load(RECORDS_DIR / f"demo-{source}-{NEW_TOKENS}.npz") as data:
        return {name: data[name] for name in data.files}


def _served(thresholds: dict[int, float], records: dict) -> dict[str, float]:
    from controlplane.stats.exits import policy_outcomes

    layers = [int(k) for k in records["exit_layers"]]
    first, disagree = policy_outcomes(records["signals"], records["matched"],
                                      [thresholds[k] for k in layers])
    return {"exit_rate": round(float((first < len(layers)).mean()), 3),
            "disagreement": round(float(disagree.mean()), 3)}


def story_trial(records: dict[str, dict], *, requests: int, seed: int) -> dict:
    """One replay of the story's calibration, the maps on every source and the recalibration."""
    from controlplane.calibration.learn_then_test import calibrate_thresholds
    from controlplane.calibration.segments import calibrate_segments

    chat, code = records["chat"], records["code"]
    layers = [int(k) for k in chat["exit_layers"]]
    mine = {name: records[name]["request"] < requests for name in ("chat", "code")}
    result = calibrate_segments(
        signals=np.concatenate([chat["signals"][mine["chat"]], code["signals"][mine["code"]]]),
        matched=np.concatenate([chat["matched"][mine["chat"]], code["matched"][mine["code"]]]),
        segments=np.array(["chat"] * int(mine["chat"].sum()) + ["code"] * int(mine["code"].sum())),
        requests=np.concatenate([chat["request"][mine["chat"]],
                                 10_000 + code["request"][mine["code"]]]),
        exit_layers=layers, num_layers=int(chat["num_layers"]), delta=DELTA, epsilon=EPSILON,
        min_samples_per_layer=MIN_SAMPLES, learn_fraction=LEARN_FRACTION, seed=seed)
    trial: dict = {"seed": seed}
    for name in ("chat", "code"):
        decided = result.segments[name]
        trial[name] = {"source": decided.source,
                       **{f"on_{s}": _served(decided.thresholds, records[s]) for s in SOURCES}}
    manifests = records["manifests"]
    recalibrated = calibrate_thresholds(
        signals=manifests["signals"], matched=manifests["matched"], exit_layers=layers,
        num_layers=int(manifests["num_layers"]), delta=DELTA, epsilon=EPSILON / 2,
        min_samples_per_layer=MIN_SAMPLES, learn_fraction=LEARN_FRACTION, seed=seed)
    trial["code_recalibrated_on_manifests"] = _served(recalibrated.thresholds, manifests)
    return trial


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40,
                        help="requests per segment the story's calibration sees")
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    print("command: .venv/bin/python -P bench/demo_segments.py "
          f"--requests {args.requests} --seeds {args.seeds}")
    produce_records()
    records = {source: _load(source) for source in SOURCES}
    trials = [story_trial(records, requests=args.requests, seed=seed)
              for seed in range(args.seeds)]
    own = [t for t in trials if t["code"]["source"] == "segment"]

    def span(key: str, source: str) -> list[float]:
        values = [t["code"][f"on_{source}"][key] for t in own]
        return [min(values), max(values)] if values else []

    print(json.dumps({
        "tokens": {s: len(records[s]["signals"]) for s in SOURCES},
        "trials": trials, "code_own_map_trials": len(own),
        "code_map_disagreement_range": {s: span("disagreement", s) for s in SOURCES},
        "code_map_exit_rate_range": {s: span("exit_rate", s) for s in SOURCES},
        "delta": DELTA, "epsilon": EPSILON}))


if __name__ == "__main__":
    main()
