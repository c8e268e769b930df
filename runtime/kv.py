"""The KV cache: slot allocation, per-layer fill bookkeeping and the skipped-layer policies.

Layout: keys/values (L, S, Hkv, T, D) preallocated for S slots of T positions; a request owns
one slot for its lifetime and the batcher only ever sees slot ids.

A token that exits after d layers leaves layers d+1..L without KV at its position. Policies:
- `lazy`: its hidden state waits in `pending_hidden`; the next token of that sequence that goes
  deeper carries the pending positions through the skipped layers in the same pass (see
  engine), so every KV entry, once written, equals what the full model computes.
- `propagate` (CALM): the exited state is projected through the skipped layers' K/V
  projections only; the cache is complete immediately but approximate.

`filled[s, j]` counts the positions of slot s whose layer-j KV exists. Each token makes every
earlier position at least as deep as itself, so depth is non-increasing along positions and the
positions pending at layer j are exactly the suffix [filled[s, j], length).
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from runtime.model import DecoderParts

POLICIES = ("lazy", "propagate")


class KVCache:
    """Preallocated per-slot KV storage with lazy / propagate fill of skipped layers."""

    def __init__(self, parts: DecoderParts, *, max_slots: int, max_len: int,
                 policy: str = "lazy"):
        if policy not in POLICIES:
            raise ValueError(f"unknown KV policy {policy!r}; choose one of {POLICIES}")
        self.parts = parts
        self.policy = policy
        self.max_slots = max_slots
        self.max_len = max_len
        shape = (parts.num_layers, max_slots, parts.num_kv_heads, max_len, parts.head_dim)
        self.keys = torch.zeros(shape, dtype=parts.dtype, device=parts.device)
        self.values = torch.zeros(shape, dtype=parts.dtype, device=parts.device)
        self.pending_hidden = torch.zeros((max_slots, max_len, parts.hidden_size),
                                          dtype=parts.dtype, device=parts.device)
        self.filled = np.zeros((max_slots, parts.num_layers), dtype=np.int64)
        self._free = list(range(max_slots))
        self._kv_proj: torch.Tensor | None = None

    # -- slots -------------------------------------------------------------------------
    def allocate(self) -> int:
        """Take the lowest free slot (keeps active slots contiguous when possible)."""
        if not self._free:
            raise RuntimeError(f"all {self.max_slots} KV slots are in use")
        self._free.sort()
        slot = self._free.pop(0)
        self.filled[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        if slot in self._free:
            raise ValueError(f"slot {slot} is not allocated")
        self._free.append(slot)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    # -- bookkeeping ---------------------------------------------------------------------
    def mark_filled(self, slot: int, depth: int, length: int) -> None:
        """Positions < length now have KV at layers < depth."""
        self.filled[slot, :depth] = np.maximum(self.filled[slot, :depth], length)

    def pending_count(self, slots: np.ndarray, positions: np.ndarray, layer: int) -> np.ndarray:
        """Earlier positions of each slot that still lack KV at `layer` (0-based)."""
        return positions - self.filled[slots, layer]

    def complete(self, slot: int, length: int) -> bool:
        """Whether every layer has KV for positions < length."""
        return bool((self.filled[slot] >= length).all())

    # -- writes ----------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor,
              keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store (N, Hkv, D) keys/values at (slots[i], positions[i]) of `layer`."""
        self.keys[layer][slots, :, positions] = keys
        self.values[layer][slots, :, positions] = values

    def layer_kv(self, layer: int, slots: torch.Tensor | None, length: int,
                 batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, Hkv, length, D) views (slots None: slots 0..batch-1) or gathered copies."""
        keys = self.keys[layer, :, :, :length]
        values = self.values[layer, :, :, :length]
        if slots is None:
            return keys[:batch], values[:batch]
        return keys.index_select(0, slots), values.index_select(0, slots)

    def fill_skipped(self, depth: int, slots: torch.Tensor, positions: torch.Tensor,
                     hidden: torch.Tensor, *, slots_np: np.ndarray, positions_np: np.ndarray,
                     rotary: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Tokens leaving after `depth` layers with (N, hidden) states: by policy, stash them
        for a later deep token (lazy) or project their K/V through every later layer now.

        `slots_np`/`positions_np` are the same rows on the host (bookkeeping never reads the
        device); `rotary` is the (T, D) cos/sin table propagate rotates keys with."""
        if self.policy == "propagate":
            cos, sin = rotary
            self.propagate(depth, slots, positions, hidden, cos[positions], sin[positions])
            depth_filled = self.parts.num_layers
        else:
            self.stash(slots, positions, hidden)
            depth_filled = depth
        for slot, pos in zip(slots_np, positions_np, strict=True):
            self.mark_filled(int(slot), depth_filled, int(pos) + 1)

    def stash(self, slots: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor) -> None:
        """Lazy policy: keep exited hidden states (N, hidden) until a deeper token needs them."""
        self.pending_hidden[slots, positions] = hidden

    def propagate(self, depth: int, slots: torch.Tensor, positions: torch.Tensor,
                  hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """CALM fill: K/V of layers depth..L-1 from the exited state `hidden` (N, hidden)."""
        parts = self.parts
        if depth >= parts.num_layers:
            return
        w = self._stacked_kv_projection()[depth:]  # (L', 2*Hkv*D, hidden)
        normed = hidden.float() * torch.rsqrt(hidden.float().pow(2).mean(-1, keepdim=True)
                                              + self._eps())
        kv = torch.einsum("lah,nh->lna", w, normed.to(w.dtype))  # (L', N, 2*Hkv*D)
        n_layers, n = kv.shape[0], kv.shape[1]
        kv = kv.view(n_layers, n, 2, parts.num_kv_heads, parts.head_dim)
        keys, values = kv[:, :, 0], kv[:, :, 1]  # (L', N, Hkv, D)
        # rotate keys with each position's angles: cos/sin (N, D) -> (1, N, 1, D)
        keys, _ = apply_rotary_pos_emb(keys, keys, cos[None], sin[None], unsqueeze_dim=2)
        layer_idx = torch.arange(depth, parts.num_layers, device=hidden.device)
        self.keys[layer_idx[:, None], slots[None, :], :, positions[None, :]] = keys
        self.values[layer_idx[:, None], slots[None, :], :, positions[None, :]] = values

    def _eps(self) -> float:
        norm = self.parts.layers[0].input_layernorm
        return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-5)))

    def _stacked_kv_projection(self) -> torch.Tensor:
        """[k_proj; v_proj] of every layer with its input RMSNorm weight folded in."""
        if self._kv_proj is None:
            mats = []
            for layer in self.parts.layers:
                gain = layer.input_layernorm.weight.float()
                w = torch.cat([layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight])
                mats.append(w.float() * gain[None, :])
            self._kv_proj = torch.stack(mats).to(self.parts.dtype)
        return self._kv_proj
