"""What one decode step applies: a threshold version as an `ExitPolicy`, and the per-row plan
(`RowPlan`) that gives each row of a batch its own segment's thresholds.

A threshold set may hold per-segment maps (issue 18); a row applies `for_segment(its
segment)`: its segment's own map, else the set's `thresholds` (`default`). The engine turns
that into a (rows, exit layers) table once per step, on the host, so the exit check stays one
comparison of a (B,) signal against a (B,) column, whatever mix of segments shares the batch.
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
        names = set(self.thresholds)
        for by_layer in self.segments.values():
            names |= set(by_layer)
        return tuple(sorted(names))

    def served_layers(self, segment: str | None = DEFAULT_SEGMENT) -> frozenset[int]:
        """Exit layers a row of `segment` needs checked: a threshold of 1.0 can never be
        passed, so those checks are skipped, except where saturation needs its chain."""
        by_layer = self.for_segment(segment)
        live = frozenset(k for k, t in by_layer.items() if t < NEVER_EXIT)
        if self.signal == Signal.saturation and live:
            return frozenset(k for k in by_layer if k <= max(live))
        return live

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
        layers = policy.layers
        column = {layer: e for e, layer in enumerate(layers)}
        by_segment: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for name in set(segments):
            by_layer, served = policy.for_segment(name), policy.served_layers(name)
            # float32 like the signals: the comparison rounds each threshold as a scalar
            # threshold would be rounded, so an all-default batch exits exactly as before.
            limit = np.array([by_layer.get(k, NEVER_EXIT) for k in layers], dtype=np.float32)
            by_segment[name] = (limit, np.array([k in served for k in layers], dtype=bool))
        limits = np.stack([by_segment[name][0] for name in segments])
        counted = np.stack([by_segment[name][1] if by_segment[name][1].any()
                            else np.full(len(layers), bool(row_shadow))
                            for name, row_shadow in zip(segments, shadow, strict=True)])
        return cls(layers=layers, column=column, limits=limits.reshape(len(segments), -1),
                   counted=counted.reshape(len(segments), -1))
