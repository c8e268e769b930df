"""Reference generations for the engine's tests: what Hugging Face's own greedy decoding at full
depth gives."""

from __future__ import annotations

import torch


def greedy_full_depth(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt's `new_tokens` generated tokens under `model.generate` (greedy, no stop
    token), one prompt at a time. The attention mask is explicit: a model whose pad id occurs in
    its prompts (SmolLM2's is <|im_end|>, which its chat template writes) would otherwise have
    those prompt tokens masked out."""
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs
