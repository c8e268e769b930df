"""The runtime benchmark behind `bench/runtime.py` and `exitplane runtime bench`.

Same process, same machine, held-out prompts: HF `generate` vs our engine at full depth vs
early exit at thresholds calibrated on shadow samples of other held-out prompts; agreement
teacher-forced and free-running; batch-8 compaction vs mask-only; the speed-quality curve per
heads mode; and the cost of one exit check per signal relative to one decoder layer.
Prints tables, then one JSON line (the last line).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from pathlib import Path

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
    parser.add_argument("--calibration-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--signal", default="learned", choices=[s.value for s in Signal])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    return parser.parse_args(argv)


def timed(fn):
    """(result, seconds)."""
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


def hf_generate(model, prompts, max_new_tokens, eos):
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=list(eos), pad_token_id=eos[0])
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


def run_engine(model, heads, prompts, max_new_tokens, *, policy=None, batch=1,
               batching="compact", shadow_rate=0.0):
    """(generations, records, seconds) for one engine configuration."""
    engine = Engine(model, heads=heads, config=EngineConfig(
        max_batch=batch, max_seq_len=1024, batching=batching, shadow_rate=shadow_rate))
    if policy is not None:
        engine.set_thresholds(policy)
    generated, seconds = timed(lambda: engine.generate(prompts, max_new_tokens=max_new_tokens))
    return generated, engine.drain_records(), seconds


def calibrate(records: list[TokenRecord], exit_layers: list[int], target: float,
              signal: Signal) -> tuple[ExitPolicy, dict]:
    """The lowest common threshold whose simulated disagreement on shadow records <= target.

    A token exits at the first exit layer whose signal beats the threshold; it disagrees when
    that layer's top-1 did not match full depth. (The control plane's calibration is the
    statistically guarded version of this; here it only picks bench thresholds.)
    """
    shadows = [r.shadow for r in records if r.shadow]
    values = sorted({round(p.signal, 4) for s in shadows for p in s})
    grid = values[:: max(1, len(values) // 300)]
    for tau in grid:
        exits = wrong = 0
        for points in shadows:
            hit = next((p for p in points if p.signal > tau), None)
            if hit is not None:
                exits += 1
                wrong += not hit.matched
        if shadows and wrong / len(shadows) <= target:
            policy = ExitPolicy(version=1, signal=signal,
                                thresholds=dict.fromkeys(exit_layers, tau))
            return policy, {"threshold": tau,
                            "calibration_exit_rate": round(exits / len(shadows), 4)}
    return ExitPolicy.never_exit(exit_layers, signal), {"threshold": 1.0,
                                                         "calibration_exit_rate": 0.0}


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

    def per_call(fn) -> float:
        for _ in range(10):
            fn()
        started = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - started) / repeats * 1e6

    layer_us = per_call(lambda: engine._layer(10, x, slots, pos, None, 257))
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


def evaluate_heads(mode, path, args, eval_ids, calib_ids, full_ref) -> dict | None:
    """Calibrate on shadow samples, run early exit at every target, measure quality."""
    if not Path(path).exists():
        print(f"[{mode}] no heads at {path}; train them with "
              f"`exitplane runtime train-heads --mode {mode}`")
        return None
    model, _, heads = load_served(args.model, heads_path=path, device=args.device)
    layers = heads.exit_layers
    signal = Signal(args.signal)
    full, _, full_s = run_engine(model, heads, eval_ids, args.max_new_tokens)
    full_tokens = sum(map(len, full))
    _, shadow_records, _ = run_engine(model, heads, calib_ids, args.max_new_tokens,
                                      batch=args.batch, shadow_rate=1.0,
                                      policy=ExitPolicy.never_exit(layers, signal))
    result = {"mode": mode, "digest": heads.digest, "full_tok_s": full_tokens / full_s,
              "heldout": heads.metadata.get("heldout"), "curve": {}, "full": full,
              "matches_original": full == full_ref}
    for target in TARGETS:
        policy, cal = calibrate(shadow_records, layers, target, signal)
        ee, records, seconds = run_engine(model, heads, eval_ids, args.max_new_tokens,
                                          policy=policy)
        tokens = sum(map(len, ee))
        rate, first = free_running(ee, full)
        point = {**cal, "tok_s": tokens / seconds, "speedup": (tokens / seconds)
                 / result["full_tok_s"], "teacher_forced": teacher_forced(model, eval_ids, ee),
                 "free_running_disagreement": rate, "first_divergence": first,
                 "mean_exit_layer": statistics.mean(r.exit_layer for r in records),
                 "histogram": histogram(records), "policy": policy}
        result["curve"][target] = point
    result["model"] = model
    result["heads"] = heads
    return result


def batch_runs(result, args, eval_ids) -> dict:
    model, heads = result["model"], result["heads"]
    policy = result["curve"][0.01]["policy"]
    out = {}
    for name, kwargs in {"full": {}, "mask": {"policy": policy, "batching": "mask"},
                         "compact": {"policy": policy, "batching": "compact"}}.items():
        generated, _, seconds = run_engine(model, heads, eval_ids, args.max_new_tokens,
                                           batch=args.batch, **kwargs)
        out[name] = sum(map(len, generated)) / seconds
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    base, tokenizer = load_model(args.model, device=args.device)
    eos = list(Engine(base).parts.eos_token_ids)
    prompts = corpus.HELD_OUT_PROMPTS
    eval_ids = [corpus.chat_prompt_ids(tokenizer, p) for p in prompts[: args.prompts]]
    calib_ids = [corpus.chat_prompt_ids(tokenizer, p)
                 for p in prompts[args.prompts: args.prompts + args.calibration_prompts]]
    hf_out, hf_s = timed(lambda: hf_generate(base, eval_ids, args.max_new_tokens, eos))
    ours, _, ours_s = run_engine(base, None, eval_ids, args.max_new_tokens)
    hf_tok_s = sum(map(len, hf_out)) / hf_s
    base_full_tok_s = sum(map(len, ours)) / ours_s
    print(f"HF generate: {hf_tok_s:.1f} tok/s; engine full depth: {base_full_tok_s:.1f} tok/s; "
          f"token-identical: {ours == hf_out}")
    results = [r for r in (evaluate_heads(m, p, args, eval_ids, calib_ids, hf_out)
                           for m, p in (("post-hoc", args.heads_post_hoc),
                                        ("joint", args.heads_joint))) if r is not None]
    summary = {"hf_tok_s": round(hf_tok_s, 2), "full_tok_s": round(base_full_tok_s, 2),
               "full_matches_hf": ours == hf_out, "num_layers": Engine(base).parts.num_layers,
               "model": model_name(args.model), "max_new_tokens": args.max_new_tokens,
               "eval_prompts": len(eval_ids), "signal": args.signal}
    if not results:
        summary.update(check_costs(base, None))
        print(json.dumps(summary))
        return 0
    print_curves(results)
    best = max(results, key=lambda r: r["curve"][0.01]["speedup"])
    point = best["curve"][0.01]
    batch = batch_runs(best, args, eval_ids)
    costs = check_costs(best["model"], best["heads"])
    print_main_table(summary, best, point, batch, costs)
    summary.update({
        "heads_mode": best["mode"], "heads_digest": best["digest"],
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
        "speedup_curve": {str(t): round(best["curve"][t]["speedup"], 3) for t in TARGETS},
        "speedup_curves": {r["mode"]: {str(t): round(r["curve"][t]["speedup"], 3)
                                       for t in TARGETS} for r in results},
        "agreement_curves": {r["mode"]: {str(t): round(r["curve"][t]["teacher_forced"], 4)
                                         for t in TARGETS} for r in results},
        "check_costs": costs,
    })
    print(json.dumps(summary))
    return 0


def print_curves(results) -> None:
    print("\nspeed-quality curve (thresholds calibrated on shadow samples of other prompts)")
    print(f"{'heads':<9}{'target':>7}{'thr':>8}{'speedup':>9}{'agree TF':>10}"
          f"{'free dis':>10}{'1st div':>9}{'mean exit':>10}")
    for r in results:
        for target, p in r["curve"].items():
            print(f"{r['mode']:<9}{target:>7.3f}{p['threshold']:>8.3f}{p['speedup']:>9.2f}"
                  f"{p['teacher_forced']:>10.4f}{p['free_running_disagreement']:>10.4f}"
                  f"{p['first_divergence']:>9.1f}{p['mean_exit_layer']:>10.2f}")


def print_main_table(summary, best, point, batch, costs) -> None:
    rows = [("HF generate (greedy), batch 1", summary["hf_tok_s"]),
            ("engine, full depth, batch 1", summary["full_tok_s"]),
            (f"engine, full depth ({best['mode']} served model)", best["full_tok_s"]),
            (f"engine, early exit @1% ({best['mode']}), batch 1", point["tok_s"]),
            (f"batch {8}: full depth", batch["full"]),
            ("batch 8: early exit, mask-only", batch["mask"]),
            ("batch 8: early exit, compaction", batch["compact"])]
    print(f"\n{'configuration':<52}{'tok/s':>8}{'ms/token':>10}")
    for name, tok_s in rows:
        print(f"{name:<52}{tok_s:>8.1f}{1000 / max(tok_s, 1e-9):>10.1f}")
    print(f"\nearly exit @1%: speedup {point['speedup']:.2f}x, teacher-forced agreement "
          f"{point['teacher_forced']:.4f}, free-running disagreement "
          f"{point['free_running_disagreement']:.4f}, mean exit layer "
          f"{point['mean_exit_layer']:.2f}/{summary['num_layers']}, "
          f"exit histogram {point['histogram']}")
    print("\none check vs one decoder layer (batch 1):")
    for name, value in costs.items():
        print(f"  {name:<22}{value:>10}")
