"""Real shadow samples for `bench/calibration.py --real`: the real model on two text domains.

(`-P`: bench/runtime.py must not shadow the `runtime` package.)

Shadow labels under teacher forcing (what runtime shadow sampling measures, DESIGN.md): at each
token position, per exit layer, the learned confidence (the `learned` signal) and whether that
exit's top-1 equals the full model's top-1. Two domains:

- `chat`: the model's own greedy answers to the held-out prompts (`runtime.corpus`), answer
  positions only (what a runtime decodes); `--chat-prompts train` reuses the answers cached when
  the heads were trained instead (no generation; that text is in the heads' training data);
- `code`: Python standard-library source files taken from the end of the file list (training
  used the first ones), cut into 128-token chunks.

    .venv/bin/python -P bench/real_shadow_samples.py \\
        --heads var/runtime/heads-post-hoc.safetensors --out var/shadow_samples.npz
    .venv/bin/python bench/calibration.py --real var/shadow_samples.npz

The last line is one JSON object with the sample counts and per-layer agreement.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from runtime import corpus
from runtime.engine import Engine, EngineConfig
from runtime.model import decoder_parts, load_served


@torch.no_grad()
def shadow_labels(model, heads, sequences: list[list[int]], starts: list[int],
                  batch: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """(signals (n, L), matched (n, L)) at positions start-1 .. len-2 of each sequence (the
    positions that predict tokens start .. len-1)."""
    layers = heads.exit_layers
    lm_head = decoder_parts(model).lm_head
    signals, matched = [], []
    for first in range(0, len(sequences), batch):
        chunk, chunk_starts = sequences[first:first + batch], starts[first:first + batch]
        width = max(map(len, chunk))
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.bool)
        keep = torch.zeros(len(chunk), width, dtype=torch.bool)
        for row, (seq, start) in enumerate(zip(chunk, chunk_starts, strict=True)):
            ids[row, :len(seq)] = torch.tensor(seq)
            mask[row, :len(seq)] = True
            keep[row, max(start - 1, 0):len(seq) - 1] = True
        out = model(input_ids=ids, attention_mask=mask.long(), output_hidden_states=True)
        final = out.logits[keep].argmax(-1)  # (n,)
        per_layer_signal, per_layer_match = [], []
        for k in layers:
            hidden = out.hidden_states[k][keep].float()  # (n, hidden)
            per_layer_signal.append(heads.match_probability(k, hidden))
            per_layer_match.append(heads.exit_logits(k, hidden, lm_head).argmax(-1) == final)
        signals.append(torch.stack(per_layer_signal, dim=1).numpy())
        matched.append(torch.stack(per_layer_match, dim=1).numpy())
    return np.concatenate(signals).astype(np.float32), np.concatenate(matched)


def chat_domain(model, tokenizer, args) -> tuple[list[list[int]], list[int]]:
    if args.chat_prompts == "train":  # the answers cached by train-heads: nothing to generate
        prompts, new_tokens = corpus.TRAIN_PROMPTS[:48], 96
    else:
        prompts, new_tokens = corpus.HELD_OUT_PROMPTS[: args.prompts], args.new_tokens
    engine = Engine(model, config=EngineConfig(max_batch=8, max_seq_len=512))
    sequences = corpus.generations(engine, tokenizer, prompts, max_new_tokens=new_tokens,
                                   model_name="smollm2-135m-instruct")
    starts = [len(corpus.chat_prompt_ids(tokenizer, p)) for p in prompts]
    return sequences, starts


def code_domain(tokenizer, args) -> tuple[list[list[int]], list[int]]:
    texts, tokens = [], 0
    for path in reversed(corpus.stdlib_files()):
        try:
            text = path.read_text(encoding="utf-8")[:4000]
        except UnicodeDecodeError:
            continue
        texts.append(text)
        tokens += len(text) // 3
        if tokens >= args.code_tokens:
            break
    chunks = corpus.token_chunks(tokenizer, texts, 128)
    return chunks, [1] * len(chunks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", required=True, help="exit heads (.safetensors)")
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--out", default="var/shadow_samples.npz")
    parser.add_argument("--chat-prompts", choices=["heldout", "train"], default="heldout",
                        help="train: reuse the answers cached when the heads were trained "
                             "(no generation, but text the heads were trained on)")
    parser.add_argument("--prompts", type=int, default=len(corpus.HELD_OUT_PROMPTS))
    parser.add_argument("--new-tokens", type=int, default=160)
    parser.add_argument("--code-tokens", type=int, default=12_000)
    args = parser.parse_args()
    print("command:", " ".join([sys.executable, *sys.argv]))
    torch.set_grad_enabled(False)
    started = time.perf_counter()
    model, tokenizer, heads = load_served(args.model, heads_path=args.heads)
    heads.float()
    parts = {}
    for name, (sequences, starts) in {"chat": chat_domain(model, tokenizer, args),
                                      "code": code_domain(tokenizer, args)}.items():
        parts[name] = shadow_labels(model, heads, sequences, starts)
        signals, matched = parts[name]
        print(f"{name}: {len(signals)} tokens; agreement per exit layer "
              f"{dict(zip(heads.exit_layers, matched.mean(0).round(3).tolist(), strict=True))}")
    signals = np.concatenate([parts[n][0] for n in parts])
    matched = np.concatenate([parts[n][1] for n in parts])
    domain = np.concatenate([[n] * len(parts[n][0]) for n in parts])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, signals=signals, matched=matched,
                        exit_layers=np.array(heads.exit_layers),
                        num_layers=decoder_parts(model).num_layers, domain=domain)
    print(json.dumps({"out": args.out, "tokens": {n: len(parts[n][0]) for n in parts},
                      "exit_layers": heads.exit_layers,
                      "agreement": {n: parts[n][1].mean(0).round(4).tolist() for n in parts},
                      "seconds": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()
