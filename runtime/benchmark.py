"""The runtime benchmark behind `bench/runtime.py` and `exitplane runtime bench`.

Same process, same machine, held-out prompts: HF `generate` vs our engine at full depth vs
early exit at thresholds calibrated on shadow samples of other held-out prompts; agreement
teacher-forced and free-running; batch-8 compaction vs mask-only; the speed-quality curve per
heads mode; the cost of one exit check per signal relative to one decoder layer; and what
early exit saves on this machine: the early-exit run (and one with shadow tokens) against the
full-depth run on the same prompts, measured, and through a cost model fitted on the runs' own
token records (`fit_cost`: bench/runtime.py passes the control plane's fit).
Prints tables, then one JSON line (the last line).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from exitplane.wire import Signal, TokenRecord
from runtime import corpus, signals
from runtime.engine import Engine, EngineConfig, ExitPolicy
from runtime.heads import ExitHeads
from runtime.model import load_model, load_served, model_name

TARGETS = (0.005, 0.01, 0.02, 0.05)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/runtime.py", description=__doc__)
    parser.add_argument("--model", default=None, help="checkpoint dir or .gguf (default SmolLM2)")
    parser.add_argument("--heads-post-hoc", default=str(corpus.cache_dir()
                                                        / "heads-post-hoc.safetensors"))
    parser.add_argument("--heads-joint", default=str(corpus.cache_dir()
                                                     / "heads-joint.safetensors"))
    parser.add_argument("--prompts", type=int, default=8, help="evaluation prompts")
    parser.add_argument("--calibration-prompts", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--signal", default="learned", choices=[s.value for s in Signal])
    parser.add_argument("--shadow-rate", type=float, default=0.05,
                        help="shadow share of the watched early-exit run (the net saving's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    return parser.parse_args(argv)


def timed(fn):
    """(result, seconds)."""
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


def hf_generate(model, prompts, max_new_tokens, eos):
    """Greedy HF generate of exactly max_new_tokens (EOS does not stop it, as in our runs)."""
    outputs = []
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        for prompt in prompts:
            ids = torch.tensor([prompt], device=model.device)
            # An explicit mask: inferred from pad_token_id it would mask the prompt's own
            # <|im_end|> tokens on SmolLM2 (pad = eos = <|im_end|>) and change the output.
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=eos[0])
            outputs.append(out[0, len(prompt):].tolist())
    finally:
        model.generation_config.eos_token_id = saved
    return outputs


def run_engine(model, heads, prompts, max_new_tokens, *, policy=None, batch=1,
               batching="compact", shadow_rate=0.0, seed=0):
    """(generations, records, seconds) for one engine configuration.

    Every run generates exactly max_new_tokens: an early-exited EOS would otherwise end a
    sequence early, and prefill / a half-empty batch would then decide tokens per second.
    """
    engine = Engine(model, heads=heads, config=EngineConfig(
        max_batch=batch, max_seq_len=1024, batching=batching, shadow_rate=shadow_rate,
        seed=seed))
    if policy is not None:
        engine.set_thresholds(policy)
    generated, seconds = timed(lambda: engine.generate(prompts, max_new_tokens=max_new_tokens,
                                                       stop_token_ids=[]))
    return generated, engine.drain_records(), seconds


def simulate(signal: np.ndarray, matched: np.ndarray, thresholds: np.ndarray,
             layers: np.ndarray, num_layers: int) -> tuple[int, float]:
    """(disagreements, mean exit layer) when each token leaves at its first passing exit."""
    passing = signal > thresholds[None, :]  # (N, E)
    exits = passing.any(axis=1)
    first = passing.argmax(axis=1)
    wrong = int((exits & ~matched[np.arange(len(first)), first]).sum())
    depth = np.where(exits, layers[first], num_layers)
    return wrong, float(depth.mean())


def calibrate(records: list[TokenRecord], exit_layers: list[int], target: float,
              signal: Signal, num_layers: int, levels: int = 40) -> tuple[ExitPolicy, dict]:
    """Per-layer thresholds from shadow samples: greedily lower the threshold that saves the
    most depth per added disagreement while simulated disagreement stays <= target.

    (The control plane's calibration is the statistically guarded version; this only picks
    bench thresholds, and the bench then measures agreement on other prompts.)
    """
    shadows = [r.shadow for r in records if r.shadow and len(r.shadow) == len(exit_layers)]
    if not shadows:
        return ExitPolicy.never_exit(exit_layers, signal), {"threshold": 1.0}
    sig = np.array([[p.signal for p in points] for points in shadows])  # (N, E)
    hit = np.array([[p.matched for p in points] for points in shadows])
    layers = np.array(exit_layers)
    budget = int(target * len(shadows))
    grid = [np.unique(np.quantile(sig[:, e], np.linspace(0.0, 1.0, levels)))[::-1]
            for e in range(len(exit_layers))]
    current = np.ones(len(exit_layers))
    wrong, depth = simulate(sig, hit, current, layers, num_layers)
    while True:
        best = None
        for e in range(len(exit_layers)):
            for tau in grid[e]:
                if tau >= current[e]:
                    continue
                trial = current.copy()
                trial[e] = tau
                w, d = simulate(sig, hit, trial, layers, num_layers)
                if w > budget or d >= depth:
                    continue
                score = (depth - d) / (w - wrong + 1)
                if best is None or score > best[0]:
                    best = (score, e, tau, w, d)
        if best is None:
            break
        _, e, tau, wrong, depth = best
        current[e] = tau
    thresholds = {k: float(round(t, 6)) for k, t in zip(exit_layers, current, strict=True)}
    policy = ExitPolicy(version=1, signal=signal, thresholds=thresholds)
    return policy, {"threshold": thresholds, "calibration_disagreement": wrong / len(shadows),
                    "calibration_mean_exit_layer": round(depth, 2)}


def oracle_bound(records: list[TokenRecord], exit_layers: list[int], num_layers: int) -> dict:
    """What the exits could give with a perfect exit check, from shadow samples: each token
    leaving at the first exit whose top-1 equals the final one (zero disagreement, no check
    cost) -- the ceiling on speed-up for these adapters; and, per layer, the share of tokens
    the signal ranks confidently enough for 99% precision (what a real check can take)."""
    shadows = [r.shadow for r in records if r.shadow and len(r.shadow) == len(exit_layers)]
    if not shadows:
        return {}
    sig = np.array([[p.signal for p in points] for points in shadows])
    hit = np.array([[p.matched for p in points] for points in shadows])
    depth = np.full(len(hit), float(num_layers))
    for e in reversed(range(len(exit_layers))):
        depth[hit[:, e]] = exit_layers[e]
    coverage = {}
    for e, layer in enumerate(exit_layers):
        ranked = hit[np.argsort(-sig[:, e], kind="stable"), e]
        precision = np.cumsum(ranked) / np.arange(1, len(ranked) + 1)
        ok = np.nonzero(precision >= 0.99)[0]
        coverage[str(layer)] = round(float((ok.max() + 1) / len(ranked)) if len(ok) else 0.0, 4)
    return {"agreement_per_layer": {str(k): round(float(hit[:, e].mean()), 4)
                                    for e, k in enumerate(exit_layers)},
            "oracle_mean_exit_layer": round(float(depth.mean()), 2),
            "oracle_speedup_bound": round(num_layers / float(depth.mean()), 3),
            "coverage_at_99_precision": coverage}


def free_running(ee: list[list[int]], full: list[list[int]]) -> tuple[float, float]:
    """(token disagreement rate, mean first-divergence position) vs full-depth generations."""
    wrong = total = 0
    firsts = []
    for a, b in zip(ee, full, strict=True):
        n = max(len(a), len(b))
        diffs = [i for i in range(n) if i >= len(a) or i >= len(b) or a[i] != b[i]]
        wrong += len(diffs)
        total += n
        firsts.append(diffs[0] if diffs else n)
    return wrong / max(1, total), statistics.mean(firsts) if firsts else 0.0


@torch.no_grad()
def teacher_forced(model, prompts, generated) -> float:
    """Share of early-exit tokens equal to the full model's top-1 given the same context."""
    agree = total = 0
    for prompt, tokens in zip(prompts, generated, strict=True):
        if not tokens:
            continue
        ids = torch.tensor([prompt + tokens[:-1]], device=model.device)
        top1 = model(ids).logits[0, len(prompt) - 1:].argmax(-1).tolist()
        agree += sum(int(a == b) for a, b in zip(top1, tokens, strict=True))
        total += len(tokens)
    return agree / max(1, total)


@torch.inference_mode()
def check_costs(model, heads: ExitHeads | None, repeats: int = 200) -> dict:
    """Microseconds of one decoder layer (batch 1, 256 cached positions) and each check."""
    engine = Engine(model, heads=heads, config=EngineConfig(max_batch=1, max_seq_len=512))
    engine.add_request(list(range(1, 258)), max_new_tokens=2, stop_token_ids=[])
    engine._admit()
    parts, dev = engine.parts, engine.parts.device
    x = torch.randn(1, 1, parts.hidden_size, device=dev, dtype=parts.dtype)
    slots, pos = torch.tensor([0], device=dev), torch.tensor([[256]], device=dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def per_call(fn) -> float:
        for _ in range(10):
            fn()
        sync()
        started = time.perf_counter()
        for _ in range(repeats):
            fn()
        sync()
        return (time.perf_counter() - started) / repeats * 1e6

    layer_us = per_call(lambda: engine.decoder.layer(10, x, slots, pos, 257))
    hidden = x[:, 0]
    layer = engine.exit_layers[len(engine.exit_layers) // 2]
    costs = {"decoder_layer_us": round(layer_us, 1)}
    for signal in Signal:
        if signal == Signal.learned and heads is None:
            continue
        state = signals.SignalState(1, dev)
        us = per_call(lambda s=signal, st=state: signals.check(s, engine.readout, layer,
                                                               hidden, st))
        costs[f"{signal.value}_us"] = round(us, 1)
        costs[f"{signal.value}_vs_layer"] = round(us / layer_us, 3)
    return costs


def histogram(records: list[TokenRecord]) -> dict[int, int]:
    return dict(sorted(Counter(r.exit_layer for r in records).items()))


class Tally:
    """Tokens, seconds and outputs of one configuration, accumulated prompt by prompt."""

    def __init__(self):
        self.tokens, self.seconds, self.outputs, self.records = 0, 0.0, [], []

    def add(self, outputs, records, seconds) -> None:
        self.tokens += sum(map(len, outputs))
        self.seconds += seconds
        self.outputs.extend(outputs)
        self.records.extend(records)

    @property
    def tok_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def served_variants(args, base) -> list[dict]:
    """Each available heads mode with its served model (joint: LoRA merged into a copy)."""
    variants = []
    for mode, path in (("post-hoc", args.heads_post_hoc), ("joint", args.heads_joint)):
        if not Path(path).exists():
            print(f"[{mode}] no heads at {path}; train them with "
                  f"`exitplane runtime train-heads --mode {mode}`")
            continue
        heads = ExitHeads.load(path, device=args.device)
        model = base
        if heads.lora:
            model, _, heads = load_served(args.model, heads_path=path, device=args.device)
        variants.append({"mode": mode, "model": model, "heads": heads, "curve": {}})
    return variants


def calibrate_variant(variant, args, calib_ids) -> None:
    """Shadow-sample the calibration prompts at full depth; pick thresholds per target."""
    signal = Signal(args.signal)
    layers = variant["heads"].exit_layers
    _, records, _ = run_engine(variant["model"], variant["heads"], calib_ids,
                               args.max_new_tokens, batch=args.batch, shadow_rate=1.0,
                               policy=ExitPolicy.never_exit(layers, signal))
    variant["shadow_tokens"] = len(records)
    variant["oracle"] = oracle_bound(records, layers, variant["model"].config.num_hidden_layers)
    for target in TARGETS:
        policy, info = calibrate(records, layers, target, signal,
                                 variant["model"].config.num_hidden_layers)
        variant["curve"][target] = {"policy": policy, **info}


def interleaved_runs(base, variants, args, eval_ids, eos) -> dict[str, Tally]:
    """Every configuration on each prompt in turn, so machine load hits them alike."""
    tallies: dict[str, Tally] = {}

    def run(name, fn):
        outputs, records, seconds = fn()
        tallies.setdefault(name, Tally()).add(outputs, records, seconds)

    for index, prompt in enumerate(eval_ids):
        run("hf", lambda p=prompt: _hf_run(base, p, args.max_new_tokens, eos))
        run("full", lambda p=prompt: run_engine(base, None, [p], args.max_new_tokens))
        for v in variants:
            m, h = v["model"], v["heads"]
            if m is not base:
                run(f"{v['mode']}:full", lambda p=prompt, m=m, h=h: run_engine(
                    m, h, [p], args.max_new_tokens))
            for target, point in v["curve"].items():
                run(f"{v['mode']}:{target}", lambda p=prompt, m=m, h=h, pol=point["policy"]:
                    run_engine(m, h, [p], args.max_new_tokens, policy=pol))
            # a seed per prompt: one seed would draw the same few shadow rows on every prompt
            run(f"{v['mode']}:watched", lambda p=prompt, m=m, h=h, i=index,
                pol=v["curve"][WATCHED_TARGET]["policy"]: run_engine(
                    m, h, [p], args.max_new_tokens, policy=pol, shadow_rate=args.shadow_rate,
                    seed=i))
    return tallies


def _hf_run(model, prompt, max_new_tokens, eos):
    outputs, seconds = timed(lambda: hf_generate(model, [prompt], max_new_tokens, eos))
    return outputs, [], seconds


WATCHED_TARGET = 0.01  # the point the summary reports, served with shadow tokens
BATCH_TARGET = TARGETS[-1]  # compaction only differs from mask-only when rows exit


def batch_runs(variant, args, eval_ids, rounds: int = 2) -> dict[str, float]:
    """Batch-8 tok/s: full depth vs early exit mask-only vs compaction, alternated, at the
    loosest disagreement target (the one where most rows leave early)."""
    model, heads = variant["model"], variant["heads"]
    policy = variant["curve"][BATCH_TARGET]["policy"]
    configs = {"full": {}, "mask": {"policy": policy, "batching": "mask"},
               "compact": {"policy": policy, "batching": "compact"}}
    tallies = {name: Tally() for name in configs}
    for _ in range(rounds):
        for name, kwargs in configs.items():
            tallies[name].add(*run_engine(model, heads, eval_ids, args.max_new_tokens,
                                          batch=args.batch, **kwargs))
    return {name: t.tok_s for name, t in tallies.items()}


def cost_groups(records: list[TokenRecord]) -> dict[str, list]:
    """The timed records as `fit_cost` takes them: one group per (depth, checks), with its
    tokens, summed exit checks and summed wall time (records without checks are left out)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for record in records:
        if record.exit_checks is None:
            continue
        group = groups.setdefault((record.exit_layer, record.exit_checks), [0, 0])
        group[0] += 1
        group[1] += record.latency_us
    keys = sorted(groups)
    return {"depths": [depth for depth, _ in keys],
            "checks": [key[1] * groups[key][0] for key in keys],
            "latency_us": [groups[key][1] for key in keys],
            "tokens": [groups[key][0] for key in keys]}


def savings(full: Tally, early: Tally, watched: Tally, fit_cost, num_layers: int) -> dict:
    """What early exit saves against full depth on the same prompts: the measured speed-ups
    (early exit alone, and with shadow tokens), and the cost model fitted on all three runs'
    records with its net saving on the watched run (checks and shadow tokens included: a
    shadow token runs to full depth and computes every check). Negative savings are losses."""
    found = {"measured_speedup": round(early.tok_s / full.tok_s, 3),
             "watched_speedup": round(watched.tok_s / full.tok_s, 3),
             "measured_net_saving": round(1 - full.tok_s / watched.tok_s, 4),
             "watched_shadow_tokens": sum(r.shadow is not None for r in watched.records)}
    if fit_cost is None:
        return found
    model = fit_cost(**cost_groups(full.records + early.records + watched.records),
                     num_layers=num_layers)
    if model is None:
        return found
    served = [r for r in watched.records if r.exit_checks is not None]
    spent = sum(model.token_us(r.exit_layer, r.exit_checks) for r in served)
    baseline = model.full_depth_us * len(served)
    shadow = [r for r in served if r.shadow is not None]
    found.update({
        "cost_model": {key: round(value, 2) if isinstance(value, float) else value
                       for key, value in model.as_dict().items()},
        "model_net_saving": round(1 - spent / baseline, 4),
        "model_net_saved_us_per_token": round((baseline - spent) / len(served), 1),
        "check_cost_share": round(model.check_us * sum(r.exit_checks for r in served)
                                  / baseline, 4),
        "shadow_tokens_measured_us": round(float(np.mean([r.latency_us for r in shadow])), 1)
        if shadow else None})
    return found


def print_savings(found: dict, shadow_rate: float) -> None:
    """The cost model and the net saving, in words; a loss is reported as a loss."""
    print(f"\nwhat early exit saves on this machine (same prompts, batch 1, "
          f"{WATCHED_TARGET:.0%} target):")
    print(f"  measured speed-up against full depth: {found['measured_speedup']:.3f}x; with "
          f"{shadow_rate:.0%} shadow tokens {found['watched_speedup']:.3f}x")
    model = found.get("cost_model")
    if model is None:
        print("  cost model: not fitted (`exitplane runtime bench` leaves it to bench/runtime.py;"
              " there, too few timed tokens or depths, or timings too noisy for a positive time"
              " per layer, leave it unidentified)")
        net = found["measured_net_saving"]
    else:
        print(f"  cost model ({model['tokens']} timed tokens): {model['overhead_us'] / 1e3:.2f} "
              f"ms overhead + {model['layer_us'] / 1e3:.3f} ms per layer + "
              f"{model['check_us'] / 1e3:.3f} ms per exit check; full depth "
              f"{model['full_depth_us'] / 1e3:.2f} ms per token")
        if found["shadow_tokens_measured_us"] is not None:
            print(f"  a shadow token measured {found['shadow_tokens_measured_us'] / 1e3:.2f} ms "
                  f"(it labels every exit point)")
        net = found["model_net_saving"]
        print(f"  net saving after checks ({found['check_cost_share']:.1%} of full depth) and "
              f"shadow tokens: {net:+.1%} ({found['model_net_saved_us_per_token'] / 1e3:+.2f} ms"
              f" per token); measured {found['measured_net_saving']:+.1%}")
    if net <= 0:
        print("  early exit does not pay on this machine at this target")


def main(argv: list[str] | None = None, *, fit_cost=None) -> int:
    """The benchmark; `fit_cost` fits the cost model from token records (the control plane's
    `fit_cost_model`: the runtime does not import the control plane, bench/runtime.py does)."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_at_start = os.getloadavg()[0]  # other work on a shared machine skews every figure
    base, tokenizer = load_model(args.model, device=args.device)
    probe = Engine(base)
    eos, num_layers = list(probe.parts.eos_token_ids), probe.parts.num_layers
    prompts = corpus.HELD_OUT_PROMPTS
    eval_ids = [corpus.chat_prompt_ids(tokenizer, p) for p in prompts[: args.prompts]]
    calib_ids = [corpus.chat_prompt_ids(tokenizer, p)
                 for p in prompts[args.prompts: args.prompts + args.calibration_prompts]]
    variants = served_variants(args, base)
    for variant in variants:
        calibrate_variant(variant, args, calib_ids)
    tallies = interleaved_runs(base, variants, args, eval_ids, eos)
    hf, full = tallies["hf"], tallies["full"]
    summary = {"hf_tok_s": round(hf.tok_s, 2), "full_tok_s": round(full.tok_s, 2),
               "full_vs_hf": round(full.tok_s / hf.tok_s, 3),
               "full_matches_hf": full.outputs == hf.outputs, "num_layers": num_layers,
               "model": model_name(args.model), "max_new_tokens": args.max_new_tokens,
               "eval_prompts": len(eval_ids), "calibration_prompts": len(calib_ids),
               "signal": args.signal, "threads": args.threads,
               "load_avg_1m_at_start": round(load_at_start, 2)}
    print(f"HF generate {hf.tok_s:.1f} tok/s, engine full depth {full.tok_s:.1f} tok/s "
          f"({full.tok_s / hf.tok_s:.2f}x), token-identical: {full.outputs == hf.outputs}")
    if not variants:
        summary.update(check_costs(base, None))
        print(json.dumps(summary))
        return 0
    for v in variants:
        ref = tallies.get(f"{v['mode']}:full", full)
        v["full_tok_s"] = ref.tok_s
        for target, point in v["curve"].items():
            t = tallies[f"{v['mode']}:{target}"]
            rate, first = free_running(t.outputs, ref.outputs)
            point.update({"tok_s": t.tok_s, "speedup": t.tok_s / ref.tok_s,
                          "teacher_forced": teacher_forced(v["model"], eval_ids, t.outputs),
                          "free_running_disagreement": rate, "first_divergence": first,
                          "mean_exit_layer": statistics.mean(r.exit_layer for r in t.records),
                          "histogram": histogram(t.records)})
    print_curves(variants)
    best = max(variants, key=lambda v: v["curve"][WATCHED_TARGET]["speedup"])
    point = best["curve"][WATCHED_TARGET]
    batch = batch_runs(best, args, eval_ids)
    costs = check_costs(best["model"], best["heads"])
    print_main_table(summary, best, point, batch, costs)
    found = savings(tallies.get(f"{best['mode']}:full", full),
                    tallies[f"{best['mode']}:{WATCHED_TARGET}"],
                    tallies[f"{best['mode']}:watched"], fit_cost, num_layers)
    print_savings(found, args.shadow_rate)
    summary.update(savings=found, shadow_rate=args.shadow_rate)
    summary.update({
        "heads_mode": best["mode"], "heads_digest": best["heads"].digest,
        "served_full_tok_s": round(best["full_tok_s"], 2),
        "ee_tok_s": round(point["tok_s"], 2), "speedup": round(point["speedup"], 3),
        "agreement_teacher_forced": round(point["teacher_forced"], 4),
        "agreement_free_running": round(1 - point["free_running_disagreement"], 4),
        "first_divergence_mean": round(point["first_divergence"], 1),
        "mean_exit_layer": round(point["mean_exit_layer"], 2),
        "exit_histogram": point["histogram"], "threshold": point["threshold"],
        "batch8_full_tok_s": round(batch["full"], 2),
        "batch8_mask_tok_s": round(batch["mask"], 2),
        "batch8_compact_tok_s": round(batch["compact"], 2),
        "batch8_target": BATCH_TARGET,
        "oracle": {v["mode"]: v["oracle"] for v in variants},
        "speedup_curve": {str(t): round(best["curve"][t]["speedup"], 3) for t in TARGETS},
        "speedup_curves": {v["mode"]: {str(t): round(v["curve"][t]["speedup"], 3)
                                       for t in TARGETS} for v in variants},
        "agreement_curves": {v["mode"]: {str(t): round(v["curve"][t]["teacher_forced"], 4)
                                         for t in TARGETS} for v in variants},
        "heldout": {v["mode"]: v["heads"].metadata.get("heldout") for v in variants},
        "check_costs": costs,
        "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
    })
    print(json.dumps(summary))
    return 0


def print_curves(variants) -> None:
    print("\nspeed-quality curve (thresholds calibrated on shadow samples of other prompts)")
    print(f"{'heads':<9}{'target':>7}{'cal exit':>9}{'speedup':>9}{'agree TF':>10}"
          f"{'free dis':>10}{'1st div':>9}{'mean exit':>10}")
    for v in variants:
        for target, p in v["curve"].items():
            cal = p.get("calibration_mean_exit_layer", float("nan"))
            print(f"{v['mode']:<9}{target:>7.3f}{cal:>9.2f}{p['speedup']:>9.2f}"
                  f"{p['teacher_forced']:>10.4f}{p['free_running_disagreement']:>10.4f}"
                  f"{p['first_divergence']:>9.1f}{p['mean_exit_layer']:>10.2f}")


def print_main_table(summary, best, point, batch, costs) -> None:
    rows = [("HF generate (greedy), batch 1", summary["hf_tok_s"]),
            ("engine, full depth, batch 1", summary["full_tok_s"]),
            (f"engine, full depth ({best['mode']} served model)", best["full_tok_s"]),
            (f"engine, early exit @1% ({best['mode']}), batch 1", point["tok_s"]),
            (f"batch {8}: full depth", batch["full"]),
            (f"batch 8: early exit @{BATCH_TARGET:.0%}, mask-only", batch["mask"]),
            (f"batch 8: early exit @{BATCH_TARGET:.0%}, compaction", batch["compact"])]
    print(f"\n{'configuration':<52}{'tok/s':>8}{'ms/token':>10}")
    for name, tok_s in rows:
        print(f"{name:<52}{tok_s:>8.1f}{1000 / max(tok_s, 1e-9):>10.1f}")
    print(f"\nearly exit @1%: speedup {point['speedup']:.2f}x, teacher-forced agreement "
          f"{point['teacher_forced']:.4f}, free-running disagreement "
          f"{point['free_running_disagreement']:.4f}, mean exit layer "
          f"{point['mean_exit_layer']:.2f}/{summary['num_layers']}, "
          f"exit histogram {point['histogram']}")
    oracle = best.get("oracle") or {}
    if oracle:
        print(f"\nceiling with a perfect exit check ({best['mode']} heads): mean exit layer "
              f"{oracle['oracle_mean_exit_layer']}, {oracle['oracle_speedup_bound']}x in layers; "
              f"top-1 agreement per exit {oracle['agreement_per_layer']}; share of tokens the "
              f"signal admits at 99% precision {oracle['coverage_at_99_precision']}")
    print("\none check vs one decoder layer (batch 1):")
    for name, value in costs.items():
        print(f"  {name:<22}{value:>10}")
