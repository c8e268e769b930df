"""Decoder math: one Llama decoder layer run by hand over the engine's KV cache.

`model.py` describes the modules (`DecoderParts`), `kv.py` owns the cache, and this module is
the layer arithmetic between them (gpt-fast's `model.py` forward, split off so the cache stays
out of the model description). The decode loop in `engine.py` calls `decode_layer` once per
layer; prefill calls `layer` with a causal mask.

Nothing here reads the device: row choices arrive as host-side numpy arrays and become index
tensors (a boolean mask index is a device->host sync on CUDA, an index tensor is not).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from runtime.kv import KVCache
from runtime.model import DecoderParts
from runtime.step import Rows, to_device


class Decoder:
    """The decoder layers of one model over one KV cache, with the rotary table built once."""

    def __init__(self, parts: DecoderParts, cache: KVCache, max_len: int):
        self.parts = parts
        self.cache = cache
        positions = torch.arange(max_len, device=parts.device)[None]
        probe = torch.zeros(1, dtype=parts.dtype, device=parts.device)
        cos, sin = parts.rotary(probe, positions)
        self.cos, self.sin = cos[0], sin[0]  # (T, D) rotary table, same math as HF

    def decode_layer(self, layer: int, x: torch.Tensor, rows: Rows) -> torch.Tensor:
        """One layer for the (B, hidden) tokens of a decode step's active rows.

        Rows whose earlier positions still lack this layer's KV (lazy policy) get those
        positions added as extra queries in the same pass."""
        pending = self.cache.pending_count(rows.slots_np, rows.positions_np, layer)  # host
        if pending.max() > 0:
            return self.layer_with_pending(layer, x, rows.slots, rows.positions, pending,
                                           rows.length)
        return self.layer(layer, x[:, None], rows.slots, rows.positions[:, None], rows.length,
                          mask=rows.mask, contiguous=rows.contiguous)[:, 0]

    def layer(self, layer: int, x: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
              length: int, *, mask: torch.Tensor | None = None, causal: bool = False,
              write: torch.Tensor | None = None, contiguous: bool = False) -> torch.Tensor:
        """One decoder layer for (B, Q, hidden) queries at `positions` (B, Q); writes their KV.

        `write` (flat indices into B*Q) limits which queries store KV; `contiguous` says the
        slots are 0..B-1, so the cache is read as a view instead of a gather."""
        block = self.parts.layers[layer]
        attn = block.self_attn
        batch, q_len, _ = x.shape
        h = block.input_layernorm(x)
        q = attn.q_proj(h).view(batch, q_len, -1, attn.head_dim).transpose(1, 2)  # (B,H,Q,D)
        k = attn.k_proj(h).view(batch, q_len, -1, attn.head_dim).transpose(1, 2)  # (B,Hkv,Q,D)
        v = attn.v_proj(h).view(batch, q_len, -1, attn.head_dim).transpose(1, 2)
        cos, sin = self.cos[positions], self.sin[positions]  # (B, Q, D)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        flat_slots = slots[:, None].expand(batch, q_len).reshape(-1)  # (B*Q,)
        flat_positions = positions.reshape(-1)
        new_k = k.transpose(1, 2).reshape(batch * q_len, -1, attn.head_dim)  # (B*Q, Hkv, D)
        new_v = v.transpose(1, 2).reshape(batch * q_len, -1, attn.head_dim)
        if write is not None:
            flat_slots, flat_positions = flat_slots[write], flat_positions[write]
            new_k, new_v = new_k[write], new_v[write]
        self.cache.write(layer, flat_slots, flat_positions, new_k, new_v)
        keys, values = self.cache.layer_kv(layer, None if contiguous else slots, length, batch)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal,
                                             scale=attn.scaling, enable_gqa=True)
        out = attn.o_proj(out.transpose(1, 2).reshape(batch, q_len, -1))  # (B, Q, H*D)
        x = x + out
        return x + block.mlp(block.post_attention_layernorm(x))

    def layer_with_pending(self, layer: int, x: torch.Tensor, slots: torch.Tensor,
                           positions: torch.Tensor, pending: np.ndarray,
                           length: int) -> torch.Tensor:
        """Lazy fill: run this layer on [pending positions..., current token] of each row.

        Queries are right-aligned (B, Q); padding queries sit at earlier positions whose KV
        exists, write nothing and are dropped, so each real query sees exactly the keys the
        full model would. Returns the current tokens' (B, hidden) output.
        """
        device = x.device
        batch, q_len = len(pending), int(pending.max()) + 1
        # which queries are real, worked out on the host: (B, Q) right-aligned
        valid = np.arange(q_len)[None] >= (q_len - 1 - pending)[:, None]
        carried = valid.copy()
        carried[:, -1] = False  # the current token is returned, not stashed
        offsets = torch.arange(q_len, device=device) - (q_len - 1)
        query_pos = (positions[:, None] + offsets[None]).clamp(min=0)  # (B, Q)
        stacked = self.cache.pending_hidden[slots[:, None], query_pos]  # (B, Q, hidden)
        stacked[:, -1] = x
        key_pos = torch.arange(length, device=device)
        mask = (key_pos[None, None, :] <= query_pos[:, :, None])[:, None]  # (B, 1, Q, T)
        out = self.layer(layer, stacked, slots, query_pos, length, mask=mask,
                         write=to_device(np.flatnonzero(valid), device))
        stash = to_device(np.flatnonzero(carried), device)
        self.cache.stash(slots[:, None].expand(batch, q_len).reshape(-1)[stash],
                         query_pos.reshape(-1)[stash], out.reshape(batch * q_len, -1)[stash])
        return out[:, -1]
