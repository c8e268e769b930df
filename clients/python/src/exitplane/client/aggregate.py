"""Exact edge aggregation: what every token adds to the control plane's rollups, counted on the
runtime so that the token itself need not travel.

Per (minute, threshold version, traffic segment, layer) the aggregator counts the tokens that
exited there, the histogram of their signal at exit and what they cost (summed wall time and
exit checks, carried by a cell only when every one of its tokens reported its checks); the
control plane derives "tokens that reached a layer" (exits at or past it) and takes shadow
labels from the shadow records, which are always shipped (docs/protocol.md, "Aggregates"). A
cut hands over the counts since the previous cut as `AggregateCell`s, so merging batches is
plain addition and a replayed batch id adds nothing.

Segments are only keys here: the runtime caps the names it tracks (overflow goes to
`default`) and the control plane caps what it stores, so the aggregator holds what it is given.

Pure Python on purpose: no numpy in the client. `add` is a few dict operations under a lock
(the decode thread adds, the shipper's thread cuts).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from exitplane.wire import (
    DEFAULT_SEGMENT,
    HISTOGRAM_BINS,
    AggregateCell,
    TokenRecord,
    signal_bin,
)

# Per slot: [exits, bin 0, ..., bin 19, timed tokens, summed latency_us, summed exit_checks]
_TIMED = 1 + HISTOGRAM_BINS
_WIDTH = _TIMED + 3


class Aggregator:
    """Counts of tokens per (minute, threshold version, segment, exit layer) since the last
    `cut`."""

    def __init__(self, *, exit_layers: Iterable[int], num_layers: int) -> None:
        self.layers = sorted({*exit_layers, num_layers})
        self._slot = {layer: slot for slot, layer in enumerate(self.layers)}
        # (minute, version, segment) -> per slot [exits, bins..., timed, latency_us, checks]
        self._cells: dict[tuple[int, int, str], list[list[int]]] = {}
        self._lock = threading.Lock()
        self.pending_tokens = 0

    def fits(self, record: TokenRecord) -> bool:
        """Whether the control plane would count this record (it exits at a known layer)."""
        return record.exit_layer in self._slot

    def add(self, record: TokenRecord) -> bool:
        """Count one token; False (not counted) when it exits at a layer this deployment does
        not have, which the control plane would refuse."""
        slot = self._slot.get(record.exit_layer)
        if slot is None:
            return False
        # int() truncates toward zero like the store's minute of a (positive) unix time.
        key = (int(record.ts) // 60 * 60, record.threshold_version, record.segment)
        signal = record.signal_value
        with self._lock:
            cell = self._cells.get(key)
            if cell is None:
                cell = self._cells[key] = [[0] * _WIDTH for _ in self.layers]
            counts = cell[slot]
            counts[0] += 1
            if signal is not None:  # an unchecked token has no signal to histogram
                counts[1 + signal_bin(signal)] += 1
            if record.exit_checks is not None:
                counts[_TIMED] += 1
                counts[_TIMED + 1] += record.latency_us
                counts[_TIMED + 2] += record.exit_checks
            self.pending_tokens += 1
        return True

    def add_counts(self, *, minute: int, threshold_version: int, exits: Sequence[int],
                   histogram: Sequence[Sequence[int]],
                   segment: str = DEFAULT_SEGMENT, latency_us: Sequence[int] | None = None,
                   exit_checks: Sequence[int] | None = None) -> None:
        """Count many tokens at once (vectorised producers): `exits[i]` tokens of `segment`
        left at `self.layers[i]`, `histogram[i]` their signal-at-exit bins, and when the
        producer times its tokens, `latency_us[i]` and `exit_checks[i]` their summed wall time
        and exit checks (both or neither)."""
        if len(exits) != len(self.layers) or len(histogram) != len(self.layers):
            raise ValueError(f"expected one count per layer {self.layers}")
        if (latency_us is None) != (exit_checks is None):
            raise ValueError("latency_us and exit_checks come together or not at all")
        timed = latency_us is not None and exit_checks is not None
        if timed and (len(latency_us) != len(self.layers)
                      or len(exit_checks) != len(self.layers)):
            raise ValueError(f"expected one latency and one check count per layer {self.layers}")
        key = (int(minute) // 60 * 60, int(threshold_version), segment)
        with self._lock:
            cell = self._cells.get(key)
            if cell is None:
                cell = self._cells[key] = [[0] * _WIDTH for _ in self.layers]
            for slot, (count, bins) in enumerate(zip(exits, histogram, strict=True)):
                counts = cell[slot]
                counts[0] += int(count)
                for index, value in enumerate(bins):
                    counts[1 + index] += int(value)
                if timed:
                    counts[_TIMED] += int(count)
                    counts[_TIMED + 1] += int(latency_us[slot])
                    counts[_TIMED + 2] += int(exit_checks[slot])
            self.pending_tokens += int(sum(exits))

    def cut(self) -> list[AggregateCell]:
        """The counts since the last cut, as cells in key order (minute, version, segment,
        layer); the counts start again."""
        with self._lock:
            cells, self._cells = self._cells, {}
            self.pending_tokens = 0
        out = []
        for (minute, version, segment), slots in sorted(cells.items()):
            for layer, counts in zip(self.layers, slots, strict=True):
                if counts[0]:
                    # A cost is a cell's only when each of its tokens reported one.
                    timed = counts[_TIMED] == counts[0]
                    out.append(AggregateCell(
                        minute=minute, threshold_version=version, segment=segment, layer=layer,
                        exits=counts[0], histogram=counts[1:_TIMED],
                        latency_us=counts[_TIMED + 1] if timed else None,
                        exit_checks=counts[_TIMED + 2] if timed else None))
        return out

    def restore(self, cells: Iterable[AggregateCell]) -> None:
        """Add cells back (a cut that could be neither sent nor spooled must not be lost)."""
        for cell in cells:
            exits = [0] * len(self.layers)
            histogram = [[0] * HISTOGRAM_BINS for _ in self.layers]
            slot = self._slot[cell.layer]
            exits[slot] = cell.exits
            histogram[slot] = list(cell.histogram)
            costs = {}
            if cell.latency_us is not None and cell.exit_checks is not None:
                costs = {"latency_us": [0] * len(self.layers),
                         "exit_checks": [0] * len(self.layers)}
                costs["latency_us"][slot] = cell.latency_us
                costs["exit_checks"][slot] = cell.exit_checks
            self.add_counts(minute=cell.minute, threshold_version=cell.threshold_version,
                            exits=exits, histogram=histogram, segment=cell.segment, **costs)
