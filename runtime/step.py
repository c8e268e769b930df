"""The data of one decode step: its active rows, its typed result, on-device sampling.

Host-side numpy arrays decide which rows leave; the device only ever sees index tensors made
from them, so a step reads the device once per live exit layer (the exit decision) and once at
the end (`StepResult.to_host`), whatever the batch does in between.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from time import perf_counter

import numpy as np
import torch

from exitplane.wire import ShadowPoint


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a device tensor; an asynchronous copy, never a wait on the device."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        # from pageable memory the driver may wait for the stream before staging the copy;
        # from pinned memory it never does (the caching host allocator keeps the block alive
        # until the copy has run)
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


class Rows:
    """The active rows of one decode step; compaction keeps a subset of every field at once.

    Each field lives on the host (numpy, `*_np`) and on the device; the host copy is the one
    bookkeeping reads, so it never waits on the device.
    """

    def __init__(self, *, index_np: np.ndarray, slots_np: np.ndarray, positions_np: np.ndarray,
                 shadow_np: np.ndarray, done_np: np.ndarray, device: torch.device,
                 mask: torch.Tensor | None, length: int, limits: torch.Tensor,
                 counted: torch.Tensor):
        self.index_np = index_np  # (B,) row number within the step
        self.slots_np = slots_np  # (B,) KV slot ids
        self.positions_np = positions_np  # (B,) position of the fed token
        self.shadow_np = shadow_np  # (B,) runs to full depth, labels every exit
        self.done_np = done_np  # (B,) mask-only rows that already exited
        packed = to_device(np.stack([index_np, slots_np, positions_np, shadow_np, done_np]),
                           device)  # (5, B): one host->device copy
        self.index, self.slots, self.positions = packed[0], packed[1], packed[2]
        self.shadow, self.done = packed[3].bool(), packed[4].bool()
        self.shadow_at = to_device(np.flatnonzero(shadow_np), device)  # (S,) shadow rows
        self.mask = mask  # (B, 1, 1, T) keys each row may attend to; None for one full row
        self.length = length  # T: keys read this step
        self.contiguous = bool((slots_np == np.arange(len(slots_np))).all())
        # Each row's own segment's thresholds and whether each exit check gives the row its
        # recorded signal (policy.RowPlan, whose host copy is indexed by `index_np`).
        self.limits = limits  # (B, E) float32
        self.counted = counted  # (B, E) bool

    @classmethod
    def start(cls, slots: Sequence[int], positions: Sequence[int], shadow: Sequence[bool],
              device: torch.device, *, limits_np: np.ndarray, counted_np: np.ndarray) -> Rows:
        """Every request of the step, in order, with its (B, E) thresholds and counted checks."""
        batch, length = len(slots), max(positions) + 1
        width = limits_np.shape[1]
        plan = to_device(np.concatenate([limits_np, counted_np.astype(np.float32)], axis=1),
                         device)  # (B, 2E): one host->device copy
        rows = cls(index_np=np.arange(batch), slots_np=np.array(slots, dtype=np.int64),
                   positions_np=np.array(positions, dtype=np.int64),
                   shadow_np=np.array(shadow, dtype=bool), done_np=np.zeros(batch, dtype=bool),
                   device=device, mask=None, length=length,
                   limits=plan[:, :width], counted=plan[:, width:].bool())
        if batch > 1:
            key_pos = torch.arange(length, device=device)
            rows.mask = (key_pos[None, :] <= rows.positions[:, None])[:, None, None]  # (B,1,1,T)
        return rows

    def keep(self, keep_np: np.ndarray, keep: torch.Tensor) -> Rows:
        """The rows at host indices `keep_np` (the same indices on the device: `keep`)."""
        return Rows(index_np=self.index_np[keep_np], slots_np=self.slots_np[keep_np],
                    positions_np=self.positions_np[keep_np],
                    shadow_np=self.shadow_np[keep_np], done_np=self.done_np[keep_np],
                    device=self.index.device,
                    mask=None if self.mask is None else self.mask[keep], length=self.length,
                    limits=self.limits[keep], counted=self.counted[keep])

    def __len__(self) -> int:
        return len(self.slots_np)


class StepBuffers:
    """Per-row results of one step, filled in as rows leave; `result` finishes the step.

    Learned exits leave their head input (the vocabulary projection waits for one matmul at
    the end: at batch > 1 separate projections would each re-read the (V, hidden) head);
    logit-signal exits already paid for their logits and leave those."""

    def __init__(self, x: torch.Tensor, shadow_np: np.ndarray, num_layers: int):
        batch, device = len(x), x.device
        self.head_in = torch.zeros_like(x)  # (B, hidden)
        self.exit_logits: torch.Tensor | None = None  # (B, V) float, made at a logit exit
        self.projected_np = np.zeros(batch, dtype=bool)  # token comes from exit_logits
        self.exit_layer_np = np.full(batch, num_layers, dtype=np.int64)
        self.signal = torch.zeros(batch, device=device)
        # A token's recorded signal comes only from the checks its policy runs whatever the
        # batch holds; checks run just to label a shadow row in the same step do not count, so
        # the signal's distribution does not move with batch composition.
        self.signal_checked = torch.zeros(batch, dtype=torch.bool, device=device)
        self.shadow_rows = np.flatnonzero(shadow_np)  # (S,): constant, shadows never leave
        self.shadow_layers: list[int] = []
        self.shadow_signal: list[torch.Tensor] = []  # E x (S,)
        self.shadow_top1: list[torch.Tensor] = []  # E x (S,)
        self.exit_checks_np = np.zeros(batch, dtype=np.int64)  # checks computed per row

    def note_check(self, rows: Rows) -> None:
        """An exit check ran on every row still in the batch (a mask-only row that already
        left rides along and is checked too)."""
        self.exit_checks_np[rows.index_np] += 1

    def note_signal(self, rows: Rows, value: torch.Tensor, counted: torch.Tensor) -> None:
        """Keep each open row's signal from a check that counts for it (`counted`, (B,): one
        its own map serves; for a never-exit map, a shadow row's checks)."""
        take = counted & ~rows.done
        self.signal[rows.index] = torch.where(take, value, self.signal[rows.index])
        self.signal_checked[rows.index] |= take

    def label_shadow(self, depth: int, value: torch.Tensor, top1: torch.Tensor) -> None:
        """The shadow rows' (S,) signal and exit top-1 at exit layer `depth`."""
        self.shadow_layers.append(depth)
        self.shadow_signal.append(value)
        self.shadow_top1.append(top1)

    def exit(self, depth: int, rows: Rows, leave_np: np.ndarray, leave: torch.Tensor, *,
             head_in: torch.Tensor | None = None, logits: torch.Tensor | None = None) -> None:
        """Rows `leave` (indices into `rows`) take their token from exit layer `depth`."""
        step_rows, step_rows_np = rows.index[leave], rows.index_np[leave_np]
        self.exit_layer_np[step_rows_np] = depth
        if logits is None:
            self.head_in[step_rows] = head_in
            return
        if self.exit_logits is None:
            self.exit_logits = logits.new_zeros(len(self.head_in), logits.shape[-1])
        self.exit_logits[step_rows] = logits
        self.projected_np[step_rows_np] = True

    def result(self, lm_head: torch.nn.Module, temperature: Sequence[float],
               top_p: Sequence[float],
               generators: Sequence[torch.Generator | None]) -> StepResult:
        """Project the rows still without logits (one matmul), pick every token."""
        device = self.head_in.device
        if self.exit_logits is None:
            logits = lm_head(self.head_in)  # (B, V)
        else:
            logits = self.exit_logits
            open_np = np.flatnonzero(~self.projected_np)
            if len(open_np):
                open_rows = to_device(open_np, device)
                logits[open_rows] = lm_head(self.head_in[open_rows]).to(logits.dtype)
        greedy = logits.argmax(-1)  # (B,) top-1: what shadow labels compare with
        tokens = sample(logits, greedy, temperature, top_p, generators)
        if self.shadow_layers:
            shadow_rows = to_device(self.shadow_rows, device)
            shadow_signal = torch.stack(self.shadow_signal, dim=1)  # (S, E)
            matched = torch.stack(self.shadow_top1, dim=1) == greedy[shadow_rows][:, None]
        else:
            shadow_signal = torch.zeros(len(self.shadow_rows), 0, device=device)
            matched = shadow_signal.bool()
        return StepResult(tokens=tokens, exit_layer=self.exit_layer_np, signal=self.signal,
                          signal_checked=self.signal_checked, exit_checks=self.exit_checks_np,
                          shadow_rows=self.shadow_rows,
                          shadow_layers=self.shadow_layers, shadow_signal=shadow_signal,
                          shadow_matched=matched)


@dataclass
class StepResult:
    """What one decode step produced: B rows, S of them shadow rows checked at E exits."""

    tokens: torch.Tensor  # (B,) long, device: the emitted token
    exit_layer: np.ndarray  # (B,) host: layers the token ran
    signal: torch.Tensor  # (B,) float, device: signal at its last served check
    signal_checked: torch.Tensor  # (B,) bool, device: a served check ran for this token
    exit_checks: np.ndarray  # (B,) host: exit checks computed for the token
    shadow_rows: np.ndarray  # (S,) host: rows run to full depth to label every exit
    shadow_layers: list[int]  # (E,) the exit layers those rows were checked at
    shadow_signal: torch.Tensor  # (S, E) float, device
    shadow_matched: torch.Tensor  # (S, E) bool, device: exit top-1 == full model's top-1

    def to_host(self) -> HostStep:
        """Everything as Python values, in one device->host copy."""
        parts = [self.tokens, self.signal.clamp(0.0, 1.0), self.signal_checked]
        if self.shadow_signal.numel():
            parts += [self.shadow_signal.clamp(0.0, 1.0).flatten(), self.shadow_matched.flatten()]
        flat = torch.cat([p.to(torch.float64) for p in parts]).cpu().numpy()
        batch, width = len(self.tokens), len(self.shadow_layers)
        tokens, signal, checked, shadow_signal, matched = np.split(
            flat, np.cumsum([batch, batch, batch, self.shadow_signal.numel()]))
        shadow_signal = shadow_signal.reshape(len(self.shadow_rows), width)
        matched = matched.reshape(len(self.shadow_rows), width).astype(bool)
        return HostStep(
            tokens=tokens.astype(np.int64).tolist(), exit_layer=self.exit_layer.tolist(),
            exit_checks=self.exit_checks.tolist(),
            signal=[value if ran else None
                    for value, ran in zip(signal.tolist(), checked.astype(bool), strict=True)],
            shadow={int(row): [ShadowPoint(layer=layer, signal=value, matched=hit)
                               for layer, value, hit in zip(self.shadow_layers, values, hits,
                                                            strict=True)]
                    for row, values, hits in zip(self.shadow_rows, shadow_signal.tolist(),
                                                 matched.tolist(), strict=True)})


@dataclass(frozen=True)
class HostStep:
    """A step's result on the host: per row, and the exit points of each shadow row."""

    tokens: list[int]
    exit_layer: list[int]
    exit_checks: list[int]
    signal: list[float | None]
    shadow: dict[int, list[ShadowPoint]]


class StepClock:
    """A step's wall time shared out to its rows: each token's `latency_us` is its share, and
    the shares add up to the step.

    Each stretch between two exits goes equally to the rows in the batch through it (so a row
    that leaves at layer k pays for the layers it ran, not the deeper ones); what no row
    outlives (the final projection, sampling, the host copy) goes equally to all. Stretches
    end where the step reads the device anyway (an exit decision), so on an asynchronous
    device queued work counts where the host waited for it. Prefill is in no token's share."""

    def __init__(self, batch: int):
        self.share_s = np.zeros(batch)  # (B,) seconds charged to each row so far
        self.mark = perf_counter()  # the step starts

    def lap(self, index_np: np.ndarray) -> None:
        """Charge the stretch since the last lap to the rows at `index_np`, equally."""
        now = perf_counter()
        self.share_s[index_np] += (now - self.mark) / len(index_np)
        self.mark = now

    def latency_us(self) -> list[int]:
        """Each row's share of the whole step, in microseconds (the rest shared by all)."""
        self.lap(np.arange(len(self.share_s)))
        return np.rint(self.share_s * 1e6).astype(np.int64).tolist()


def sample(logits: torch.Tensor, greedy: torch.Tensor, temperature: Sequence[float],
           top_p: Sequence[float], generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """(B,) tokens from (B, V) logits on their device: greedy at temperature 0, else nucleus.

    A sampled row draws one uniform from its request's generator and inverts the nucleus CDF,
    so a seeded request repeats its stream whatever else shares the batch."""
    rows = [i for i, t in enumerate(temperature) if t > 0]
    if not rows:
        return greedy
    device = logits.device
    index = to_device(np.array(rows, dtype=np.int64), device)
    temp = to_device(np.array([temperature[i] for i in rows], dtype=np.float32), device)
    probs = torch.softmax(logits[index].float() / temp[:, None], dim=-1)  # (S, V)
    nucleus = [top_p[i] for i in rows]
    if min(nucleus) < 1.0:
        probs, order = probs.sort(dim=-1, descending=True)
        limit = to_device(np.array(nucleus, dtype=np.float32), device)
        probs = probs * ((probs.cumsum(-1) - probs) < limit[:, None])
    else:
        order = None
    cdf = probs.cumsum(-1)  # (S, V)
    uniform = torch.stack([torch.rand((), generator=generators[i], device=device)
                           for i in rows])  # (S,)
    choice = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)
    choice = choice.clamp(max=logits.shape[-1] - 1)  # (S, 1)
    if order is not None:
        choice = order.gather(-1, choice)
    return greedy.index_copy(0, index, choice[:, 0])
