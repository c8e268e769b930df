"""The early-exit decode loop: prefill, one decode step with per-layer exit checks, batching.

A server drives it: `add_request` queues a prompt, each `step()` admits waiting requests
(continuous batching), runs one token for every running request and returns what came out;
`cancel` frees a slot. `set_thresholds` swaps the small `ExitPolicy` object the next step
reads once, so a new threshold version never rebuilds anything.

Within a step, rows that exit at layer k leave the active set and layers k+1.. run on the
compacted tensor (`batching="compact"`); `batching="mask"` is the baseline that runs every row
to full depth and only ignores exited rows' later results.
"""

from __future__ import annotations

import itertools
import queue
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from exitplane.wire import ShadowPoint, Signal, ThresholdSetWire, TokenRecord
from runtime import signals
from runtime.heads import ExitHeads
from runtime.kv import KVCache
from runtime.model import DecoderParts, decoder_parts


class StepFailed(RuntimeError):
    """A step raised; the requests it names were dropped (slots freed), the rest carry on.

    `request_ids` holds the one request whose prefill failed, or every request of the
    failed decode batch: a decode error cannot be pinned on one row."""

    def __init__(self, request_ids: list[str]) -> None:
        super().__init__(f"step failed for {len(request_ids)} request(s)")
        self.request_ids = request_ids


def default_exit_layers(num_layers: int) -> list[int]:
    """Every 3rd layer from 6 (SmolLM2: 6, 9, ..., 27); tiny models: every 2nd from 2."""
    start, step = (6, 3) if num_layers >= 12 else (2, 2)
    return list(range(start, num_layers, step))


@dataclass(frozen=True)
class ExitPolicy:
    """What one step applies: a threshold version, its signal and per-exit-layer thresholds."""

    version: int
    signal: Signal
    thresholds: dict[int, float]
    checksum: str = ""

    @classmethod
    def from_wire(cls, wire: ThresholdSetWire, exit_layers: Iterable[int]) -> ExitPolicy:
        """Validate a pulled threshold set against this runtime's exit layers."""
        wire.verify()
        layers = set(exit_layers)
        unknown = sorted(set(wire.thresholds) - layers)
        if unknown:
            raise ValueError(f"threshold set v{wire.version} names exit layers {unknown}; "
                             f"this runtime exits at {sorted(layers)}")
        return cls(version=wire.version, signal=Signal(wire.signal),
                   thresholds={int(k): float(v) for k, v in wire.thresholds.items()},
                   checksum=wire.checksum)

    @classmethod
    def never_exit(cls, exit_layers: Iterable[int], signal: Signal = Signal.learned):
        return cls(version=0, signal=signal, thresholds=dict.fromkeys(exit_layers, 1.0))


@dataclass
class EngineConfig:
    """How the engine batches, fills skipped KV and samples shadow tokens."""

    max_batch: int = 8
    max_seq_len: int = 1024
    kv_policy: str = "lazy"
    batching: str = "compact"
    shadow_rate: float = 0.0
    seed: int = 0


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    slot: int = -1
    generated: list[int] = field(default_factory=list)
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    generator: torch.Generator | None = None

    @property
    def position(self) -> int:
        """Position of the token fed this step (the last prompt or generated token)."""
        return len(self.prompt) + len(self.generated) - 1

    @property
    def last_token(self) -> int:
        return self.generated[-1] if self.generated else self.prompt[-1]


@dataclass(frozen=True)
class StepOutput:
    """One generated token of one request."""

    request_id: str
    token: int
    record: TokenRecord
    finished: bool


class _Rows:
    """The active rows of one decode step; compaction keeps a subset of every field at once.

    Slots and positions live on the host too (numpy), so bookkeeping never reads the device.
    """

    def __init__(self, index, slots, positions, shadow, done, mask, *, index_np, shadow_np,
                 slots_np, positions_np, length):
        self.index = index  # (B,) row number within the step
        self.index_np = index_np
        self.slots = slots  # (B,) KV slot ids
        self.positions = positions  # (B,) position of the fed token
        self.shadow = shadow  # (B,) bool: runs to full depth, labels every exit
        self.done = done  # (B,) bool: mask-only rows that already exited
        self.mask = mask  # (B, 1, 1, T) keys each row may attend to; None for one full row
        self.shadow_np = shadow_np
        self.slots_np = slots_np
        self.positions_np = positions_np
        self.length = length  # T: keys read this step
        self.contiguous = bool((slots_np == np.arange(len(slots_np))).all())

    @classmethod
    def start(cls, slots: list[int], positions: list[int], shadow: list[bool],
              device: torch.device) -> _Rows:
        batch = len(slots)
        length = max(positions) + 1
        slots_t = torch.tensor(slots, device=device)
        positions_t = torch.tensor(positions, device=device)
        mask = None
        if batch > 1:
            key_pos = torch.arange(length, device=device)
            mask = (key_pos[None, :] <= positions_t[:, None])[:, None, None]  # (B, 1, 1, T)
        return cls(torch.arange(batch, device=device), slots_t, positions_t,
                   torch.tensor(shadow, device=device),
                   torch.zeros(batch, dtype=torch.bool, device=device), mask,
                   index_np=np.arange(batch), shadow_np=np.array(shadow, dtype=bool),
                   slots_np=np.array(slots),
                   positions_np=np.array(positions), length=length)

    def keep(self, keep: torch.Tensor, keep_np: np.ndarray) -> _Rows:
        return _Rows(self.index[keep], self.slots[keep], self.positions[keep], self.shadow[keep],
                     self.done[keep], None if self.mask is None else self.mask[keep],
                     index_np=self.index_np[keep_np], shadow_np=self.shadow_np[keep_np],
                     slots_np=self.slots_np[keep_np],
                     positions_np=self.positions_np[keep_np], length=self.length)

    def __len__(self) -> int:
        return len(self.slots_np)


class Engine:
    """Early-exit greedy decoding over a HF Llama-family model with continuous batching."""

    def __init__(self, model, *, heads: ExitHeads | None = None,
                 exit_layers: list[int] | None = None, config: EngineConfig | None = None,
                 threshold_set: ThresholdSetWire | None = None, runtime_id: str = "runtime-0",
                 on_record: Callable[[TokenRecord], None] | None = None):
        self.parts: DecoderParts = decoder_parts(model)
        self.config = config or EngineConfig()
        if self.config.batching not in ("compact", "mask"):
            raise ValueError(f"batching must be 'compact' or 'mask', not {self.config.batching!r}")
        self.heads = heads
        if heads is not None:
            self.exit_layers = list(heads.exit_layers)
        else:
            self.exit_layers = list(exit_layers or default_exit_layers(self.parts.num_layers))
        bad = [k for k in self.exit_layers if not 1 <= k < self.parts.num_layers]
        if bad:
            raise ValueError(f"exit layers {bad} outside 1..{self.parts.num_layers - 1}")
        self.readout = signals.ExitReadout(self.parts, heads)
        self.cache = KVCache(self.parts, max_slots=self.config.max_batch,
                             max_len=self.config.max_seq_len, policy=self.config.kv_policy)
        default_signal = Signal.learned if heads is not None else Signal.maxprob
        self.policy = ExitPolicy.never_exit(self.exit_layers, default_signal)
        if threshold_set is not None:
            self.set_thresholds(threshold_set)
        self.runtime_id = runtime_id
        self.on_record = on_record
        self.records: queue.SimpleQueue[TokenRecord] = queue.SimpleQueue()
        self._rng = random.Random(self.config.seed)
        self._waiting: OrderedDict[str, Request] = OrderedDict()
        self._running: OrderedDict[str, Request] = OrderedDict()
        self._ids = itertools.count()
        positions = torch.arange(self.config.max_seq_len, device=self.parts.device)[None]
        probe = torch.zeros(1, dtype=self.parts.dtype, device=self.parts.device)
        cos, sin = self.parts.rotary(probe, positions)
        self._cos, self._sin = cos[0], sin[0]  # (T, D) rotary table, same math as HF

    # -- control ---------------------------------------------------------------------------
    def set_thresholds(self, threshold_set: ThresholdSetWire | ExitPolicy) -> None:
        """Atomically replace the exit policy; the next step uses it, nothing is rebuilt."""
        policy = (threshold_set if isinstance(threshold_set, ExitPolicy)
                  else ExitPolicy.from_wire(threshold_set, self.exit_layers))
        if policy.signal == Signal.learned and self.heads is None:
            raise ValueError("the learned signal needs exit heads; load them with --heads")
        self.policy = policy

    def add_request(self, prompt: list[int], *, request_id: str | None = None,
                    max_new_tokens: int = 64, stop_token_ids: Iterable[int] | None = None,
                    temperature: float = 0.0, top_p: float = 1.0,
                    seed: int | None = None) -> str:
        """Queue a prompt (token ids); it joins the running batch at the next step.

        temperature 0 is greedy; otherwise the token is sampled (nucleus `top_p`) from the
        distribution of the layer the token exits at."""
        request_id = request_id or f"req-{next(self._ids)}"
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        if request_id in self._waiting or request_id in self._running:
            raise ValueError(f"request {request_id!r} already exists")
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
        if len(prompt) + max_new_tokens > self.config.max_seq_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) "
                             f"exceeds max_seq_len {self.config.max_seq_len}")
        stops = self.parts.eos_token_ids if stop_token_ids is None else tuple(stop_token_ids)
        generator = None
        if temperature > 0:
            generator = torch.Generator()  # sampling draws on the CPU
            generator.manual_seed(seed if seed is not None else self._rng.getrandbits(63))
        self._waiting[request_id] = Request(request_id, list(prompt), max_new_tokens,
                                            frozenset(stops), temperature=temperature,
                                            top_p=top_p, generator=generator)
        return request_id

    def cancel(self, request_id: str) -> bool:
        """Drop a waiting or running request and free its slot."""
        if self._waiting.pop(request_id, None) is not None:
            return True
        request = self._running.pop(request_id, None)
        if request is None:
            return False
        self.cache.release(request.slot)
        return True

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def drain_records(self) -> list[TokenRecord]:
        """Records queued since the last drain (call outside the step). Without an
        `on_record` callback every record lands in this queue; with one, none do."""
        drained = []
        while True:
            try:
                drained.append(self.records.get_nowait())
            except queue.Empty:
                return drained

    # -- the loop --------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Admit waiting requests, decode one token for every running request.

        Raises StepFailed naming the requests an exception dropped; the engine stays usable."""
        self._admit()
        if not self._running:
            return []
        requests = list(self._running.values())
        started = time.perf_counter()
        policy = self.policy  # read once: a swap lands between steps, never inside one
        try:
            result = self._decode(requests, policy)
            return self._finish(requests, result, policy, started)
        except Exception as error:
            # A half-run step leaves these rows' KV and pending state undefined: drop them
            # (freeing their slots) rather than decode on from it.
            for request in requests:
                self.cancel(request.request_id)
            raise StepFailed([r.request_id for r in requests]) from error

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int = 64,
                 stop_token_ids: Iterable[int] | None = None) -> list[list[int]]:
        """Run prompts to completion (at most max_batch at once) and return generated ids."""
        ids = [self.add_request(p, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids)
               for p in prompts]
        out: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_work:
            for item in self.step():
                out.setdefault(item.request_id, []).append(item.token)
        return [out[i] for i in ids]

    def _admit(self) -> None:
        while self._waiting and self.cache.free_slots:
            request_id, request = self._waiting.popitem(last=False)
            request.slot = self.cache.allocate()
            self._running[request_id] = request
            try:
                self._prefill(request)
            except Exception as error:
                self.cancel(request_id)
                raise StepFailed([request_id]) from error

    def _prefill(self, request: Request) -> None:
        """Run prompt[:-1] through every layer; the last prompt token goes through `step`."""
        n = len(request.prompt) - 1
        if n == 0:
            return
        device = self.parts.device
        ids = torch.tensor(request.prompt[:-1], device=device)
        x = self.parts.embed(ids)[None]  # (1, n, hidden)
        positions = torch.arange(n, device=device)[None]  # (1, n)
        slots = torch.tensor([request.slot], device=device)
        for layer in range(self.parts.num_layers):
            x = self._layer(layer, x, slots, positions, None, n, causal=True)
        self.cache.mark_filled(request.slot, self.parts.num_layers, n)

    def _decode(self, requests: list[Request], policy: ExitPolicy) -> dict:
        """One token for each request; returns per-row tokens, exit layers, signals, shadow."""
        parts, device = self.parts, self.parts.device
        batch = len(requests)
        shadow = [self._rng.random() < self.config.shadow_rate for _ in requests]
        rows = _Rows.start([r.slot for r in requests], [r.position for r in requests], shadow,
                           device)
        x = parts.embed(torch.tensor([r.last_token for r in requests], device=device))  # (B, H)
        tokens = torch.zeros(batch, dtype=torch.long, device=device)
        greedy = torch.zeros(batch, dtype=torch.long, device=device)  # top-1: shadow labels
        sampling = any(r.temperature > 0 for r in requests)
        exit_layer = torch.full((batch,), parts.num_layers, dtype=torch.long, device=device)
        signal_at = torch.zeros(batch, device=device)
        # A token's recorded signal comes only from the checks its policy runs whatever the
        # batch holds; checks run just to label a shadow row in the same step do not count, so
        # the signal's distribution does not move with batch composition.
        signal_checked = torch.zeros(batch, dtype=torch.bool, device=device)
        shadow_log: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        state = signals.SignalState(batch, device)
        # learned exits defer the vocabulary projection to one matmul at the end of the step:
        # at batch > 1 each separate projection would re-read the whole (V, hidden) head
        head_in = x.new_zeros(batch, parts.hidden_size)  # (B, hidden)
        projected_np = np.zeros(batch, dtype=bool)  # token already chosen from exit logits
        mask_only = self.config.batching == "mask"
        thresholds = policy.thresholds
        checked = self._checked_layers(policy, any(shadow))
        served = self._checked_layers(policy, False)
        for layer in range(parts.num_layers):
            x = self._layer(layer, x[:, None], rows.slots, rows.positions[:, None], rows,
                            rows.length)[:, 0]
            depth = layer + 1
            if depth not in checked:
                continue
            value, top1, logits = signals.check(policy.signal, self.readout, depth, x, state)
            if depth in served:
                signal_at[rows.index] = torch.where(rows.done, signal_at[rows.index], value)
                signal_checked[rows.index] |= ~rows.done
            elif not served:  # a never-exit set: only shadow rows (a random sample) have one
                live = rows.shadow & ~rows.done
                signal_at[rows.index] = torch.where(live, value, signal_at[rows.index])
                signal_checked[rows.index] |= live
            if rows.shadow_np.any():
                sel = rows.shadow
                shadow_top1 = (self.readout.logits(depth, x[sel]).argmax(-1) if top1 is None
                               else top1[sel])
                shadow_log.append((depth, rows.index[sel], value[sel], shadow_top1))
            leaving = (value > thresholds[depth]) & ~rows.shadow & ~rows.done
            # the one device->host read of a live exit layer; plain layers never read back
            leaving_np = leaving.cpu().numpy()
            if not leaving_np.any():
                continue
            hidden = x[leaving]
            leaving_rows = rows.index[leaving]
            if logits is None:
                head_in[leaving_rows] = self.readout.head_input(depth, hidden)
            else:  # logit signals already paid for this exit's projection
                exit_logits = logits[leaving]
                greedy[leaving_rows] = exit_logits.argmax(-1)
                tokens[leaving_rows] = (_sample(exit_logits, leaving_rows, requests)
                                        if sampling else greedy[leaving_rows])
                projected_np[rows.index_np[leaving_np]] = True
            exit_layer[leaving_rows] = depth
            if mask_only:
                rows.done = rows.done | leaving
                continue
            self._fill_skipped(depth, rows, leaving, leaving_np, hidden)
            keep = ~leaving
            rows, x = rows.keep(keep, ~leaving_np), x[keep]
            state.keep(keep)
            if len(rows) == 0:
                break
        if len(rows):
            still = ~rows.done
            head_in[rows.index[still]] = self.readout.head_input(parts.num_layers, x[still])
            for slot, pos in zip(rows.slots_np, rows.positions_np, strict=True):
                self.cache.mark_filled(int(slot), parts.num_layers, int(pos) + 1)
        open_rows = np.flatnonzero(~projected_np)
        if len(open_rows):
            index = torch.as_tensor(open_rows, device=device)
            final = parts.lm_head(head_in if len(open_rows) == batch else head_in[index])
            greedy[index] = final.argmax(-1)
            tokens[index] = _sample(final, index, requests) if sampling else greedy[index]
        return {"tokens": tokens, "greedy": greedy, "exit_layer": exit_layer, "signal": signal_at,
                "signal_checked": signal_checked, "shadow_log": shadow_log, "shadow": shadow}

    @staticmethod
    def _checked_layers(policy: ExitPolicy, shadow: bool) -> frozenset[int]:
        """Exit layers worth a check: a threshold of 1.0 can never be passed, so unless a
        shadow row needs labels (or saturation needs its chain) those checks are skipped."""
        layers = frozenset(policy.thresholds)
        if shadow:
            return layers
        live = frozenset(k for k, t in policy.thresholds.items() if t < 1.0)
        if policy.signal == Signal.saturation and live:
            return frozenset(k for k in layers if k <= max(live))
        return live

    def _fill_skipped(self, depth: int, rows: _Rows, leaving: torch.Tensor,
                      leaving_np: np.ndarray, hidden: torch.Tensor) -> None:
        """KV for layers depth+1.. of tokens leaving now (and of their pending positions)."""
        slots, positions = rows.slots[leaving], rows.positions[leaving]
        if self.cache.policy == "propagate":
            self.cache.propagate(depth, slots, positions, hidden, self._cos[positions],
                                 self._sin[positions])
            depth_filled = self.parts.num_layers
        else:
            self.cache.stash(slots, positions, hidden)
            depth_filled = depth
        for slot, pos in zip(rows.slots_np[leaving_np], rows.positions_np[leaving_np],
                             strict=True):
            self.cache.mark_filled(int(slot), depth_filled, int(pos) + 1)

    def _layer(self, layer: int, x: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
               rows: _Rows | None, length: int, *, mask: torch.Tensor | None = None,
               causal: bool = False, write: torch.Tensor | None = None) -> torch.Tensor:
        """One decoder layer for (B, Q, hidden) queries at `positions` (B, Q); writes their KV.

        In decode (rows given, Q == 1) rows whose earlier positions still lack this layer's KV
        (lazy policy) get those positions added as extra queries in the same pass.
        """
        if rows is not None:
            pending = self.cache.pending_count(rows.slots_np, rows.positions_np, layer)
            if pending.max() > 0:
                return self._layer_with_pending(layer, x, rows, pending, length)
            mask = rows.mask
        block = self.parts.layers[layer]
        attn = block.self_attn
        batch, q_len, _ = x.shape
        h = block.input_layernorm(x)
        q = attn.q_proj(h).view(batch, q_len, -1, attn.head_dim).transpose(1, 2)  # (B,H,Q,D)
        k = attn.k_proj(h).view(batch, q_len, -1, attn.head_dim).transpose(1, 2)  # (B,Hkv,Q,D)
        v = attn.v_proj(h).view(batch, q_len, -1, attn.head_dim).transpose(1, 2)
        cos, sin = self._cos[positions], self._sin[positions]  # (B, Q, D)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        flat_slots = slots[:, None].expand(batch, q_len)
        new_k, new_v = k.transpose(1, 2), v.transpose(1, 2)  # (B, Q, Hkv, D)
        if write is None:
            self.cache.write(layer, flat_slots.reshape(-1), positions.reshape(-1),
                             new_k.reshape(batch * q_len, *new_k.shape[2:]),
                             new_v.reshape(batch * q_len, *new_v.shape[2:]))
        else:
            self.cache.write(layer, flat_slots[write], positions[write], new_k[write],
                             new_v[write])
        contiguous = rows.contiguous if rows is not None else False
        keys, values = self.cache.layer_kv(layer, None if contiguous else slots, length, batch)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal,
                                             scale=attn.scaling, enable_gqa=True)
        out = attn.o_proj(out.transpose(1, 2).reshape(batch, q_len, -1))  # (B, Q, H*D)
        x = x + out
        return x + block.mlp(block.post_attention_layernorm(x))

    def _layer_with_pending(self, layer: int, x: torch.Tensor, rows: _Rows,
                            pending: np.ndarray, length: int) -> torch.Tensor:
        """Lazy fill: run this layer on [pending positions..., current token] of each row.

        Queries are right-aligned (B, Q); padding queries sit at earlier positions whose KV
        exists, write nothing and are dropped, so each real query sees exactly the keys the
        full model would.
        """
        device = x.device
        q_len = int(pending.max()) + 1
        offsets = torch.arange(q_len, device=device) - (q_len - 1)
        query_pos = (rows.positions[:, None] + offsets[None]).clamp(min=0)  # (B, Q)
        count = torch.as_tensor(pending + 1, device=device)
        valid = torch.arange(q_len, device=device)[None] >= (q_len - count)[:, None]  # (B, Q)
        stacked = self.cache.pending_hidden[rows.slots[:, None], query_pos]  # (B, Q, hidden)
        stacked[:, -1] = x[:, 0]
        key_pos = torch.arange(length, device=device)
        mask = (key_pos[None, None, :] <= query_pos[:, :, None])[:, None]  # (B, 1, Q, T)
        out = self._layer(layer, stacked, rows.slots, query_pos, None, length, mask=mask,
                          write=valid)
        carried = valid.clone()
        carried[:, -1] = False
        self.cache.stash(rows.slots[:, None].expand_as(query_pos)[carried],
                         query_pos[carried], out[carried])
        return out[:, -1:]

    def _finish(self, requests: list[Request], result: dict, policy: ExitPolicy,
                started: float) -> list[StepOutput]:
        """Append tokens, build records (one host transfer), retire finished requests."""
        tokens = result["tokens"].tolist()
        exit_layers = result["exit_layer"].tolist()
        signal_values = result["signal"].clamp(0.0, 1.0).tolist()
        signal_checked = result["signal_checked"].tolist()
        shadow_points = self._shadow_points(result, result["greedy"].tolist())
        latency_us = int((time.perf_counter() - started) * 1e6)
        now = time.time()
        outputs = []
        for row, request in enumerate(requests):
            token = tokens[row]
            record = TokenRecord(
                threshold_version=policy.version, request_id=request.request_id,
                position=len(request.generated), exit_layer=exit_layers[row],
                signal_value=signal_values[row] if signal_checked[row] else None,
                latency_us=latency_us, ts=now,
                shadow=shadow_points.get(row))
            request.generated.append(token)
            finished = (token in request.stop_token_ids
                        or len(request.generated) >= request.max_new_tokens)
            if finished:
                self._running.pop(request.request_id, None)
                self.cache.release(request.slot)
            outputs.append(StepOutput(request.request_id, token, record, finished))
            if self.on_record is not None:  # must not block: e.g. TelemetryShipper.submit
                self.on_record(record)
            else:
                self.records.put(record)
        return outputs

    @staticmethod
    def _shadow_points(result: dict, tokens: list[int]) -> dict[int, list[ShadowPoint]]:
        points: dict[int, list[ShadowPoint]] = {}
        for depth, index, value, top1 in result["shadow_log"]:
            for row, signal, exit_top1 in zip(index.tolist(), value.clamp(0, 1).tolist(),
                                              top1.tolist(), strict=True):
                points.setdefault(row, []).append(
                    ShadowPoint(layer=depth, signal=signal, matched=exit_top1 == tokens[row]))
        for row, is_shadow in enumerate(result["shadow"]):
            if is_shadow:
                points.setdefault(row, [])
        return points


def _sample(logits: torch.Tensor, rows: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Per row: greedy at temperature 0, else nucleus sampling with the request's generator."""
    picked = logits.argmax(-1)
    for i, row in enumerate(rows.tolist()):
        request = requests[row]
        if request.temperature <= 0:
            continue
        probs = torch.softmax(logits[i].float() / request.temperature, dim=-1)  # (V,)
        if request.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(-1) - sorted_probs < request.top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        choice = torch.multinomial(probs.cpu(), 1, generator=request.generator)
        picked[i] = choice.to(picked.device)[0]
    return picked
