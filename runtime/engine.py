"""The early-exit decode loop: prefill, one decode step with per-layer exit checks, batching.

A server drives it: `add_request` queues a prompt, each `step()` admits waiting requests
(continuous batching), runs one token for every running request and returns what came out;
`cancel` frees a slot. `set_thresholds` swaps the small `ExitPolicy` object the next step
reads once, so a new threshold version never rebuilds anything.

Within a step, rows that exit at layer k leave the active set and layers k+1.. run on the
compacted tensor (`batching="compact"`); `batching="mask"` is the baseline that runs every row
to full depth and only ignores exited rows' later results.

The split follows gpt-fast: `model.py` describes and loads the model, `decoder.py` is the layer
math over the KV cache (`kv.py`), `step.py` holds a step's rows, result and sampling, and this
module is the loop itself (`_decode`, one screen) with the request bookkeeping around it. A
step reads the device once per live exit layer (whether a row leaves) and once at the end.
Each request has a traffic segment; its rows apply that segment's thresholds (`policy.py`).
"""

from __future__ import annotations

import itertools
import queue
import random
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from exitplane.wire import (
    DEFAULT_SEGMENT,
    NAME_PATTERN,
    Signal,
    ThresholdSetWire,
    TokenRecord,
    default_exit_layers,
)
from runtime import signals
from runtime.decoder import Decoder
from runtime.heads import ExitHeads
from runtime.kv import KVCache
from runtime.model import DecoderParts, decoder_parts
from runtime.policy import ExitPolicy, RowPlan
from runtime.step import Rows, StepBuffers, StepClock, StepResult, to_device


class StepFailed(RuntimeError):
    """A step raised; the requests it names were dropped (slots freed), the rest carry on.

    `request_ids` holds the one request whose prefill failed, or every request of the
    failed decode batch: a decode error cannot be pinned on one row."""

    def __init__(self, request_ids: list[str]) -> None:
        super().__init__(f"step failed for {len(request_ids)} request(s)")
        self.request_ids = request_ids


@dataclass
class EngineConfig:
    """How the engine batches, fills skipped KV and samples shadow tokens and requests."""

    max_batch: int = 8
    max_seq_len: int = 1024
    kv_policy: str = "lazy"
    batching: str = "compact"
    shadow_rate: float = 0.0
    # The share of greedy requests served entirely at full depth as shadow requests (drawn
    # when a request is added without saying).
    shadow_request_rate: float = 0.0
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
    segment: str = DEFAULT_SEGMENT  # whose thresholds this request's tokens apply
    # Served entirely at full depth, every token labelled at every exit layer (a shadow
    # request: docs/protocol.md, "Shadow requests").
    shadow_request: bool = False

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


class Engine:
    """Early-exit greedy decoding over a HF Llama-family model with continuous batching."""

    # Each row applies its own segment's thresholds (ThresholdSetWire.for_segment), so the
    # threshold client hands this engine sets with per-segment maps.
    applies_segments = True

    def __init__(self, model, *, heads: ExitHeads | None = None,
                 exit_layers: list[int] | None = None, config: EngineConfig | None = None,
                 threshold_set: ThresholdSetWire | None = None, runtime_id: str = "runtime-0",
                 on_record: Callable[[TokenRecord], None] | None = None,
                 model_revision: str | None = None):
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
        # Lineage the runtime reports (runtime.model.model_revision; None: unknown).
        self.model_revision = model_revision
        self.on_record = on_record
        self.records: queue.SimpleQueue[TokenRecord] = queue.SimpleQueue()
        self._rng = random.Random(self.config.seed)
        # its own stream: drawing shadow requests leaves the shadow tokens' draws as they are
        self._request_rng = random.Random(f"{self.config.seed}-shadow-requests")
        self._waiting: OrderedDict[str, Request] = OrderedDict()
        self._running: OrderedDict[str, Request] = OrderedDict()
        # default request ids: a random prefix per engine, so a restarted runtime (same
        # runtime id) never repeats an id the control plane already assembled
        self._id_prefix = f"req-{secrets.token_hex(6)}-"
        self._ids = itertools.count()
        self.decoder = Decoder(self.parts, self.cache, self.config.max_seq_len)

    @property
    def head_digest(self) -> str | None:
        """sha256 of the exit heads artifact served (None: no heads, or heads never saved)."""
        return None if self.heads is None else self.heads.digest

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
                    seed: int | None = None, segment: str | None = None,
                    shadow_request: bool | None = None) -> str:
        """Queue a prompt (token ids); it joins the running batch at the next step.

        temperature 0 is greedy; otherwise the token is sampled (nucleus `top_p`) from the
        distribution of the layer the token exits at. `segment` picks the thresholds its
        tokens apply (the set's map for it, else `default`'s) and is on its records.
        `shadow_request` serves it entirely at full depth as a shadow request: every token
        a shadow token marked `shadow_request`, the last one `request_end` (greedy only: a
        sampled answer is not the one its evidence describes). None draws it: a greedy
        request is a shadow request with probability `config.shadow_request_rate`."""
        request_id = request_id or f"{self._id_prefix}{next(self._ids)}"
        segment = segment or DEFAULT_SEGMENT
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        if not re.fullmatch(NAME_PATTERN, segment):
            raise ValueError(f"segment {segment[:80]!r} must match {NAME_PATTERN}")
        if request_id in self._waiting or request_id in self._running:
            raise ValueError(f"request {request_id!r} already exists")
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
        if shadow_request and temperature > 0:
            raise ValueError("a shadow request decodes greedily (temperature 0)")
        if shadow_request is None:
            rate = self.config.shadow_request_rate
            shadow_request = temperature == 0 and rate > 0 and self._request_rng.random() < rate
        if len(prompt) + max_new_tokens > self.config.max_seq_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) "
                             f"exceeds max_seq_len {self.config.max_seq_len}")
        stops = self.parts.eos_token_ids if stop_token_ids is None else tuple(stop_token_ids)
        generator = None
        if temperature > 0:
            generator = torch.Generator(device=self.parts.device)  # sampling stays on device
            generator.manual_seed(seed if seed is not None else self._rng.getrandbits(63))
        self._waiting[request_id] = Request(request_id, list(prompt), max_new_tokens,
                                            frozenset(stops), temperature=temperature,
                                            top_p=top_p, generator=generator,
                                            segment=segment, shadow_request=shadow_request)
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
        clock = StepClock(len(requests))
        policy = self.policy  # read once: a swap lands between steps, never inside one
        try:
            result = self._decode(requests, policy, clock)
            return self._finish(requests, result, policy, clock)
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
        ids = to_device(np.array(request.prompt[:-1], dtype=np.int64), device)
        x = self.parts.embed(ids)[None]  # (1, n, hidden)
        positions = torch.arange(n, device=device)[None]  # (1, n)
        slots = to_device(np.array([request.slot], dtype=np.int64), device)
        for layer in range(self.parts.num_layers):
            x = self.decoder.layer(layer, x, slots, positions, n, causal=True)
        self.cache.mark_filled(request.slot, self.parts.num_layers, n)

    def _decode(self, requests: list[Request], policy: ExitPolicy,
                clock: StepClock) -> StepResult:
        """One token for each request: the layers in turn, an exit check where one is due."""
        parts, device = self.parts, self.parts.device
        # every row draws (the stream does not depend on which rows are shadow requests)
        shadow = [(self._rng.random() < self.config.shadow_rate) or r.shadow_request
                  for r in requests]
        segments = [r.segment for r in requests]
        plan = RowPlan.build(policy, segments, shadow)  # each row's own segment's thresholds
        rows = Rows.start([r.slot for r in requests], [r.position for r in requests], shadow,
                          device, limits_np=plan.limits, counted_np=plan.counted)
        fed = to_device(np.array([r.last_token for r in requests], dtype=np.int64), device)
        x = parts.embed(fed)  # (B, hidden)
        out = StepBuffers(x, rows.shadow_np, parts.num_layers)
        state = signals.SignalState(len(requests), device)
        checked = policy.checked_layers(shadow=any(shadow), segments=segments)
        for layer in range(parts.num_layers):
            x = self.decoder.decode_layer(layer, x, rows)
            depth = layer + 1
            if depth not in checked:
                continue
            value, top1, logits = signals.check(policy.signal, self.readout, depth, x, state)
            out.note_check(rows)
            column = plan.column[depth]
            if plan.counted[rows.index_np, column].any():  # host: no device read
                out.note_signal(rows, value, rows.counted[:, column])
            if len(out.shadow_rows):
                self._label_shadow(depth, rows, x, value, top1, out)
            open_np = ~rows.shadow_np & ~rows.done_np
            if not (plan.limits[rows.index_np, column][open_np] < 1.0).any():
                continue  # no open row can pass 1.0 here: skip the host read
            leaving = (value > rows.limits[:, column]) & ~rows.shadow & ~rows.done
            leaving_np = leaving.cpu().numpy()  # the one device->host read of an exit layer
            if leaving_np.any():
                clock.lap(rows.index_np)  # the layers so far ran for every row in the batch
                rows, x = self._exit(depth, rows, x, leaving, leaving_np, logits, out, state)
                if len(rows) == 0:
                    break
        if len(rows):
            self._full_depth(rows, x, out)
            clock.lap(rows.index_np)
        return out.result(parts.lm_head, [r.temperature for r in requests],
                          [r.top_p for r in requests], [r.generator for r in requests])

    def _label_shadow(self, depth: int, rows: Rows, x: torch.Tensor, value: torch.Tensor,
                      top1: torch.Tensor | None, out: StepBuffers) -> None:
        """Shadow rows' signal and exit top-1 at `depth` (a learned check has no logits yet)."""
        at = rows.shadow_at
        exit_top1 = (self.readout.logits(depth, x[at]).argmax(-1) if top1 is None
                     else top1[at])
        out.label_shadow(depth, value[at], exit_top1)

    def _exit(self, depth: int, rows: Rows, x: torch.Tensor, leaving: torch.Tensor,
              leaving_np: np.ndarray, logits: torch.Tensor | None, out: StepBuffers,
              state: signals.SignalState) -> tuple[Rows, torch.Tensor]:
        """Rows over the threshold take their token from `depth` and leave the batch."""
        leave_np = np.flatnonzero(leaving_np)
        leave = to_device(leave_np, x.device)
        hidden = x[leave]  # (N, hidden)
        if logits is None:
            out.exit(depth, rows, leave_np, leave,
                     head_in=self.readout.head_input(depth, hidden))
        else:  # logit signals already paid for this exit's projection
            out.exit(depth, rows, leave_np, leave, logits=logits[leave])
        if self.config.batching == "mask":  # the baseline: exited rows ride along
            rows.done = rows.done | leaving
            rows.done_np = rows.done_np | leaving_np
            return rows, x
        self.cache.fill_skipped(depth, rows.slots[leave], rows.positions[leave], hidden,
                                slots_np=rows.slots_np[leave_np],
                                positions_np=rows.positions_np[leave_np],
                                rotary=(self.decoder.cos, self.decoder.sin))
        keep_np = np.flatnonzero(~leaving_np)
        keep = to_device(keep_np, x.device)
        state.keep(keep)
        return rows.keep(keep_np, keep), x[keep]

    def _full_depth(self, rows: Rows, x: torch.Tensor, out: StepBuffers) -> None:
        """Rows that ran every layer: the final norm is their head input; their KV is whole."""
        parts = self.parts
        if rows.done_np.any():  # mask-only batching: some rows left earlier
            still = to_device(np.flatnonzero(~rows.done_np), x.device)
            out.head_in[rows.index[still]] = self.readout.head_input(parts.num_layers, x[still])
        else:
            out.head_in[rows.index] = self.readout.head_input(parts.num_layers, x)
        for slot, pos in zip(rows.slots_np, rows.positions_np, strict=True):
            self.cache.mark_filled(int(slot), parts.num_layers, int(pos) + 1)

    def _finish(self, requests: list[Request], result: StepResult, policy: ExitPolicy,
                clock: StepClock) -> list[StepOutput]:
        """Append tokens, build records (one host transfer), retire finished requests.

        A record's `latency_us` is its token's share of the step's wall time (`StepClock`),
        its `exit_checks` the exit checks computed for it: what a cost model is fitted on."""
        host = result.to_host()
        latency_us = clock.latency_us()
        now = time.time()
        outputs = []
        for row, request in enumerate(requests):
            token = host.tokens[row]
            finished = (token in request.stop_token_ids
                        or len(request.generated) + 1 >= request.max_new_tokens)
            record = TokenRecord(
                threshold_version=policy.version, request_id=request.request_id,
                position=len(request.generated), exit_layer=host.exit_layer[row],
                signal_value=host.signal[row], latency_us=latency_us[row], ts=now,
                shadow=host.shadow.get(row), segment=request.segment,
                exit_checks=host.exit_checks[row], shadow_request=request.shadow_request,
                request_end=request.shadow_request and finished)
            request.generated.append(token)
            if finished:
                self._running.pop(request.request_id, None)
                self.cache.release(request.slot)
            outputs.append(StepOutput(request.request_id, token, record, finished))
            if self.on_record is not None:  # must not block: e.g. TelemetryShipper.submit
                self.on_record(record)
            else:
                self.records.put(record)
        return outputs
