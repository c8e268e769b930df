"""What one decode step applies: a threshold version as an `ExitPolicy`, and the per-row plan
(`RowPlan`) that gives each row of a batch its own segment's thresholds.

A threshold set may hold per-segment maps; a row applies `for_segment(its
segment)`: its segment's own map, else the set's `thresholds` (`default`). The engine turns
that into a (rows, exit layers) table once per step, on the host, so the exit check stays one
comparison of a (B,) signal against a (B,) column, whatever mix of segments shares the batch.

Each segment's row of that table depends on the policy alone, so a policy derives them once,
when it is built (`SegmentRows`); a step only gathers the rows of its requests' segments. A
policy is immutable (a new threshold set is a new policy, with its own rows), so the cache can
never go stale.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from exitplane.wire import DEFAULT_SEGMENT, NEVER_EXIT, Signal, ThresholdSetWire


@dataclass(frozen=True)
class ExitPolicy:
    """A threshold version, its signal and per-exit-layer thresholds: `thresholds` for
    `default` (and every segment without a map), `segments` for those with one."""

    version: int
    signal: Signal
    thresholds: dict[int, float]
    checksum: str = ""
    segments: dict[str, dict[int, float]] = field(default_factory=dict)
    segment_rows: SegmentRows = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # derived once per policy, not per decode step (the maps are never mutated in place)
        object.__setattr__(self, "segment_rows", SegmentRows.derive(self))

    @classmethod
    def from_wire(cls, wire: ThresholdSetWire, exit_layers: Iterable[int]) -> ExitPolicy:
        """Validate a pulled threshold set against this runtime's exit layers."""
        wire.verify()
        layers = set(exit_layers)
        maps = {DEFAULT_SEGMENT: wire.thresholds, **(wire.segments or {})}
        for name, by_layer in maps.items():
            unknown = sorted(set(by_layer) - layers)
            if unknown:
                whose = "" if name == DEFAULT_SEGMENT else f" (segment {name!r})"
                raise ValueError(f"threshold set v{wire.version} names exit layers {unknown}"
                                 f"{whose}; this runtime exits at {sorted(layers)}")
        return cls(version=wire.version, signal=Signal(wire.signal),
                   thresholds=_floats(wire.thresholds), checksum=wire.checksum,
                   segments={name: _floats(m) for name, m in (wire.segments or {}).items()})

    @classmethod
    def never_exit(cls, exit_layers: Iterable[int], signal: Signal = Signal.learned):
        return cls(version=0, signal=signal, thresholds=dict.fromkeys(exit_layers, 1.0))

    def for_segment(self, segment: str | None) -> dict[int, float]:
        """The per-layer thresholds a row of `segment` applies (default's for any other)."""
        if segment and segment in self.segments:
            return self.segments[segment]
        return self.thresholds

    @property
    def layers(self) -> tuple[int, ...]:
        """Every exit layer any map names, ascending: the columns of a step's row table."""
        return self.segment_rows.layers

    def served_layers(self, segment: str | None = DEFAULT_SEGMENT) -> frozenset[int]:
        """Exit layers a row of `segment` needs checked: a threshold of 1.0 can never be
        passed, so those checks are skipped, except where saturation needs its chain."""
        return self.segment_rows.served_layers[self.segment_rows.row_of(segment)]

    def checked_layers(self, *, shadow: bool,
                       segments: Iterable[str | None] = (DEFAULT_SEGMENT,)) -> frozenset[int]:
        """Exit layers a step over rows of `segments` checks: every one when a shadow row
        needs labels, else those some row's own map serves."""
        if shadow:
            return frozenset(self.layers)
        checked: frozenset[int] = frozenset()
        for segment in set(segments):
            checked |= self.served_layers(segment)
        return checked


def _floats(by_layer: dict[int, float]) -> dict[int, float]:
    return {int(k): float(v) for k, v in by_layer.items()}


def _served(by_layer: dict[int, float], signal: Signal) -> frozenset[int]:
    """The exit layers a map serves (see `ExitPolicy.served_layers`)."""
    live = frozenset(k for k, t in by_layer.items() if t < NEVER_EXIT)
    if signal == Signal.saturation and live:
        return frozenset(k for k in by_layer if k <= max(live))
    return live


@dataclass(frozen=True)
class SegmentRows:
    """A policy's per-segment rows of a step's table, derived once when the policy is built.

    Row 0 is `default`'s map (and every segment without one), row i + 1 the policy's i-th
    segment map. The arrays are read-only: steps gather from them, never write.
    """

    layers: tuple[int, ...]  # E exit layers, ascending
    column: dict[int, int]  # exit layer -> column
    index: dict[str, int]  # segment with its own map -> row
    limits: np.ndarray  # (S, E) float32: the segment's threshold, 1.0 where its map has none
    served: np.ndarray  # (S, E) bool: checks the segment's map serves
    serves_none: np.ndarray  # (S,) bool: a never-exit map (its shadow rows count every check)
    served_layers: tuple[frozenset[int], ...]  # (S,) the same as `served`, as layer sets

    @classmethod
    def derive(cls, policy: ExitPolicy) -> SegmentRows:
        names = set(policy.thresholds)
        for by_layer in policy.segments.values():
            names |= set(by_layer)
        layers = tuple(sorted(names))
        maps = [policy.thresholds, *policy.segments.values()]
        served_layers = tuple(_served(by_layer, policy.signal) for by_layer in maps)
        # float32 like the signals: the comparison rounds each threshold as a scalar
        # threshold would be rounded, so an all-default batch exits as a scalar check would.
        limits = np.array([[by_layer.get(k, NEVER_EXIT) for k in layers] for by_layer in maps],
                          dtype=np.float32).reshape(len(maps), len(layers))
        served = np.array([[k in live for k in layers] for live in served_layers],
                          dtype=bool).reshape(len(maps), len(layers))
        serves_none = ~served.any(axis=1)
        for array in (limits, served, serves_none):
            array.setflags(write=False)
        return cls(layers=layers, column={layer: e for e, layer in enumerate(layers)},
                   index={name: i + 1 for i, name in enumerate(policy.segments)},
                   limits=limits, served=served, serves_none=serves_none,
                   served_layers=served_layers)

    def row_of(self, segment: str | None) -> int:
        """The row a request of `segment` applies (`default`'s for a segment without a map)."""
        return self.index.get(segment, 0) if segment else 0


@dataclass(frozen=True)
class RowPlan:
    """One step's per-row thresholds, decided on the host before the first layer runs.

    `limits[r, e]` is row r's threshold at exit layer `layers[e]` (1.0 where its map has none);
    `counted[r, e]` says whether that check gives row r's recorded signal: a check its own map
    serves, or, for a row whose map serves none (never exit), any check while it is a shadow
    row. So a token's signal never depends on which other segments share its step.
    """

    layers: tuple[int, ...]
    column: dict[int, int]  # exit layer -> column
    limits: np.ndarray  # (B, E) float32: what each row's signal must exceed
    counted: np.ndarray  # (B, E) bool

    @classmethod
    def build(cls, policy: ExitPolicy, segments: Sequence[str],
              shadow: Sequence[bool]) -> RowPlan:
        """Gather each request's segment row from the policy's table (no per-step derivation)."""
        if len(segments) != len(shadow):
            raise ValueError(f"{len(segments)} segments for {len(shadow)} shadow flags")
        table = policy.segment_rows
        at = np.fromiter((table.row_of(name) for name in segments), dtype=np.intp,
                         count=len(segments))  # (B,) each row's segment row
        shadow_np = np.fromiter(shadow, dtype=bool, count=len(shadow))  # (B,)
        counted = table.served[at] | (table.serves_none[at] & shadow_np)[:, None]  # (B, E)
        return cls(layers=table.layers, column=table.column, limits=table.limits[at],
                   counted=counted)
