"""Decode-loop A/B: the same runs against two checkouts, alternated by the caller.

    .venv/bin/python -P bench/decode_ab.py --code /work/main          # A
    .venv/bin/python -P bench/decode_ab.py --code .                   # B

Runs the engine (whichever checkout `--code` names) at full depth and with ragged maxprob
exits, at batch 1 and batch `--batch`, and prints one JSON line: tokens/s per configuration
and a digest of the generated ids (equal digests: token-identical output). On a shared
machine alternate A/B/A/B in one time window and compare the ratios.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/decode_ab.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--code", default=".", help="checkout whose runtime/ is measured")
    parser.add_argument("--model", default="tiny", help="tiny, or smollm2 (the default GGUF)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threshold", type=float, default=0.3, help="maxprob exit threshold")
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    sys.path.insert(0, os.path.abspath(args.code))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from exitplane.wire import Signal
    from runtime.engine import Engine, EngineConfig, ExitPolicy
    from runtime.model import load_model, tiny_llama

    torch.set_num_threads(args.threads)
    if args.model == "tiny":
        model, vocab = tiny_llama(seed=0, num_layers=12, hidden_size=128, vocab_size=512), 512
    else:
        model, tokenizer = load_model(None)
        vocab = len(tokenizer)
    prompts = [[1 + (7 * i + 3 * j) % (vocab - 1) for j in range(8 + 5 * i)]
               for i in range(args.prompts)]
    probe = Engine(model)
    layers = probe.exit_layers
    ragged = ExitPolicy(version=1, signal=Signal.maxprob,
                        thresholds=dict.fromkeys(layers, args.threshold))
    figures, digest = {}, hashlib.sha256()
    for name, batch, policy in (("full_b1", 1, None), (f"full_b{args.batch}", args.batch, None),
                                (f"exit_b{args.batch}", args.batch, ragged)):
        engine = Engine(model, config=EngineConfig(max_batch=batch, max_seq_len=256))
        if policy is not None:
            engine.set_thresholds(policy)
        started, cpu_started = time.perf_counter(), time.process_time()
        out = engine.generate(prompts, max_new_tokens=args.max_new_tokens, stop_token_ids=[])
        seconds = time.perf_counter() - started
        # CPU seconds of this process: steadier than wall time when others share the cores
        figures[f"{name}_cpu_s"] = round(time.process_time() - cpu_started, 3)
        layers_run = [r.exit_layer for r in engine.drain_records()]
        figures[f"{name}_tok_s"] = round(sum(map(len, out)) / seconds, 2)
        figures[f"{name}_mean_exit_layer"] = round(sum(layers_run) / len(layers_run), 2)
        digest.update(json.dumps(out).encode())
    print("command:", " ".join([sys.executable, "-P", *sys.argv]))
    print(json.dumps({"code": os.path.abspath(args.code), "model": args.model,
                      "load_avg_1m": round(os.getloadavg()[0], 2),
                      "output_digest": digest.hexdigest()[:16], **figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
