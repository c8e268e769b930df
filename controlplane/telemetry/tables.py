"""What checked batches add to the store, computed column-wise: raw token rows, shadow-sample
rows, and the per-minute rollup and signal-histogram increments (see models.Rollup).

Who counts what in the rollups: a record batch counts its tokens (tokens, exits, histogram)
and its shadow labels; a record batch flagged `aggregated` counts only its shadow labels,
because its runtime counts every token in aggregate batches, which add tokens, exits and
histograms and never shadow labels (every shadow token is always shipped as a record). So each
counter has exactly one source whatever the raw sample rate.

Traffic segments: every rollup and histogram group is keyed by (version, runtime,
minute, segment), token and shadow rows carry their segment, and a shadow token's policy
columns (would the policy have exited, and wrongly) use its version's thresholds for its
segment: the segment's own map, else the version's default (`ThresholdSetWire.for_segment`).
`segment_of` maps names the store does not take (past the deployment's cap) to `default`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import chain

import numpy as np
import pandas as pd

from controlplane.runtimes.witnesses import witness_of
from controlplane.stats.exits import passes
from controlplane.telemetry.bulk import Table, number_groups
from controlplane.telemetry.columns import BatchColumns
from controlplane.telemetry.models import HISTOGRAM_BINS
from exitplane.wire import DEFAULT_SEGMENT, AggregateBatch

ROLLUP_COUNTERS = ("tokens", "exits", "shadow_total", "shadow_matches", "policy_exits",
                   "policy_mismatches")
# What the tokens that left at a layer cost (models.Rollup): the timed ones, their summed wall
# time and exit checks, and the shadow tokens among all of them.
COST_COUNTERS = ("timed_tokens", "latency_us", "exit_checks", "shadow_tokens")
STORED_COUNTERS = ROLLUP_COUNTERS + COST_COUNTERS


class VersionThresholds(dict[int, np.ndarray]):
    """Per threshold version its default thresholds in exit-layer order (the dict itself), and
    `segments[(version, segment)]`: the thresholds of a segment with a map of its own.

    A plain dict of version -> thresholds is a set of versions without segment maps."""

    def __init__(self, by_version: Mapping[int, np.ndarray] = (),
                 segments: Mapping[tuple[int, str], np.ndarray] | None = None) -> None:
        super().__init__(by_version)
        self.segments = dict(segments or {})


def policy_thresholds(thresholds: Mapping[int, np.ndarray], version: int,
                      segment: str) -> np.ndarray:
    """What a token of `segment` under `version` applied (`ThresholdSetWire.for_segment`)."""
    own = getattr(thresholds, "segments", {})
    return own.get((version, segment), thresholds[version])


@dataclass(frozen=True)
class BatchTables:
    tokens: Table  # TokenRecordRow
    shadows: Table  # ShadowSampleRow
    rollups: Table  # Rollup increments, distinct keys in key order
    histogram: Table  # RollupHistogram increments, distinct keys in key order


def tables_of(*, deployment_id: int, exit_layers: list[int], num_layers: int,
              batches: list[BatchColumns], thresholds: Mapping[int, np.ndarray],
              segment_of: Mapping[str, str] | None = None,
              witnesses: Sequence[str] | None = None) -> BatchTables:
    """Rows and rollup increments for `batches` (thresholds: per version, in exit-layer order,
    a `VersionThresholds` where versions have segment maps; `segment_of`: the segment each
    name is stored under, where that is not the name itself; `witnesses`: who vouches for
    each batch's shadow tokens, None: each batch's runtime id)."""
    sizes = [len(batch) for batch in batches]
    count = sum(sizes)

    def joined(name: str) -> np.ndarray:
        return np.concatenate([getattr(batch, name) for batch in batches])

    def repeated(name: str) -> list:
        return list(chain.from_iterable([getattr(batch, name)] * len(batch) for batch in batches))

    version, ts = joined("threshold_version"), joined("ts")
    idx = np.concatenate([np.arange(size) for size in sizes])
    shadow_at = np.concatenate([start + batch.shadowed for start, batch in zip(
        np.cumsum([0, *sizes[:-1]]), batches, strict=True)])
    shadowed = np.zeros(count, dtype=bool)
    shadowed[shadow_at] = True
    counted = np.repeat([not batch.aggregated for batch in batches], sizes).astype(bool)
    segments, segment = _segment_codes(batches, segment_of or {})
    # What datetime.fromtimestamp(ts, UTC) gives: whole seconds, microseconds half-to-even.
    seconds = np.trunc(ts)
    micros = seconds.astype(np.int64) * 1_000_000 + np.rint((ts - seconds) * 1e6).astype(np.int64)
    moment = micros.astype("datetime64[us]")

    tokens = {"batch_id": repeated("batch_id"), "idx": idx, "ts": moment,
              "deployment_id": np.full(count, deployment_id),
              "runtime_id": repeated("runtime_id"), "threshold_version": version,
              "request_id": list(chain.from_iterable(batch.request_id for batch in batches)),
              "position": joined("position"), "exit_layer": joined("exit_layer"),
              "signal_value": joined("signal_value"), "latency_us": joined("latency_us"),
              "shadow": shadowed, "segment": _names(segments, segment)}
    labels = [shadow_labels(batch, exit_layers) for batch in batches]
    signals = np.concatenate([signal for signal, _ in labels])
    matched = np.concatenate([match for _, match in labels])
    shadows = {name: tokens[name][shadow_at] if isinstance(tokens[name], np.ndarray)
               else [tokens[name][i] for i in shadow_at.tolist()]
               for name in ("batch_id", "idx", "ts", "deployment_id", "threshold_version",
                            "runtime_id", "request_id")}
    shadows["segment"] = _names(segments, segment[shadow_at])
    if witnesses is None:
        witnesses = [witness_of(token_id=None, runtime_id=batch.runtime_id)
                     for batch in batches]
    arrived = np.datetime64(datetime.now(UTC).replace(tzinfo=None), "us")
    shadows["arrival_delay_s"] = (arrived - shadows["ts"]).astype("timedelta64[us]").astype(
        np.float64) / 1e6
    shadows["witness"] = list(chain.from_iterable(
        [witness] * len(batch.shadowed) for witness, batch in zip(witnesses, batches,
                                                                   strict=True)))
    shadows |= {"signals": signals.astype("<f4").view(np.uint8),
                "matched": matched.astype(np.uint8)}

    # Rollup groups: one per (version, runtime, minute, segment), numbered in key order.
    runtimes = sorted({batch.runtime_id for batch in batches})
    runtime = np.repeat([runtimes.index(batch.runtime_id) for batch in batches], sizes)
    minute = seconds.astype(np.int64) // 60 * 60
    keys, group = number_groups(version, runtime, minute, segment)
    key_of = _KeyColumns(deployment_id, keys, runtimes, segments)
    layers = np.unique([*exit_layers, num_layers])
    slot = np.searchsorted(layers, tokens["exit_layer"])  # one of `layers` (checked)
    cell = group * len(layers) + slot
    # Where each shadow token's signal beat its threshold: its version's, for its segment.
    pairs, pair = number_groups(version[shadow_at], segment[shadow_at])
    applied = np.array([policy_thresholds(thresholds, v, segments[s]) for v, s in zip(
        pairs[0].tolist(), pairs[1].tolist(), strict=True)]) if len(shadow_at) else \
        np.zeros((0, len(exit_layers)))
    over = passes(signals, applied[pair].reshape(signals.shape))
    timed = counted & (joined("exit_checks") >= 0)
    costs = (cell[timed], tokens["latency_us"][timed], joined("exit_checks")[timed])
    rollups = _rollups(key_of, layers, cell[counted], group[shadow_at], exit_layers, over,
                       matched, costs, cell[shadow_at])
    histogram = _histogram(key_of, layers, cell[counted], tokens["signal_value"][counted])
    return BatchTables(tokens=tokens, shadows=shadows, rollups=rollups, histogram=histogram)


def _segment_codes(batches: list[BatchColumns],
                   segment_of: Mapping[str, str]) -> tuple[list[str], np.ndarray]:
    """(stored segment names sorted, each record's index into them): names mapped through
    `segment_of`, one dict look-up per distinct name, never per record."""
    raw = batches[0].segment if len(batches) == 1 else \
        list(chain.from_iterable(batch.segment for batch in batches))
    if not raw or raw.count(raw[0]) == len(raw):  # one segment (unsegmented traffic): no hashing
        codes, names = np.zeros(len(raw), dtype=np.int64), raw[:1] or [DEFAULT_SEGMENT]
    else:  # a hash table in C (np.unique would sort the strings)
        codes, names = pd.factorize(np.array(raw, dtype=object))
        names = names.tolist()
    stored = [segment_of.get(name, name) for name in names]
    segments = sorted(set(stored))
    remap = np.array([segments.index(name) for name in stored], dtype=np.int64)
    return segments, remap[codes]


def _names(segments: list[str], code: np.ndarray) -> list[str]:
    """The text column of segment names for codes into `segments`."""
    if len(segments) == 1:
        return [segments[0]] * len(code)
    return np.array(segments, dtype=object)[code].tolist()


def shadow_labels(batch: BatchColumns, exit_layers: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(signals float64, matched bool), each (shadow tokens, exit layers) in exit-layer order.

    A checked batch has exactly one point per exit layer for each shadow token."""
    order = np.argsort(exit_layers)
    column = order[np.searchsorted(np.asarray(exit_layers)[order], batch.shadow_layer)]
    shape = (len(batch.shadowed), len(exit_layers))
    signals, matched = np.zeros(shape), np.zeros(shape, dtype=bool)
    signals[batch.shadow_owner, column] = batch.shadow_signal
    matched[batch.shadow_owner, column] = batch.shadow_matched
    return signals, matched


def _rollups(key_of: _KeyColumns, layers: np.ndarray, cell: np.ndarray,
             shadow_group: np.ndarray, exit_layers: list[int], over: np.ndarray,
             matched: np.ndarray, costs: tuple[np.ndarray, np.ndarray, np.ndarray],
             shadow_cell: np.ndarray) -> Table:
    """Rollup increments; a (group, layer) row exists once a token reached it or was labelled
    there. `cell`: the cells of the tokens counted here; `over` and `matched`: (shadow tokens,
    exit layers) in exit-layer order; `costs`: the cells, wall times and exit checks of the
    counted tokens that were timed; `shadow_cell`: the cell each shadow token left at."""
    groups, width = key_of.groups, len(layers)
    exits = np.bincount(cell, minlength=groups * width).reshape(groups, width)
    timed_cell, latency, checks = costs
    cost = np.stack([np.bincount(timed_cell, weights=weights, minlength=groups * width)
                     for weights in (None, latency, checks)], axis=-1)
    cost = np.rint(cost).astype(np.int64).reshape(groups, width, 3)
    shadow_tokens = np.bincount(shadow_cell, minlength=groups * width).reshape(groups, width)
    reached = np.cumsum(exits[:, ::-1], axis=1)[:, ::-1]  # a token's checks ran up to its exit
    policy = over & (np.cumsum(over, axis=1) == 1)  # the first layer the policy exits at
    labelled = (shadow_group[:, None] * width + np.searchsorted(layers, exit_layers)).ravel()
    shadow = np.stack([np.bincount(labelled, weights=label.ravel(), minlength=groups * width)
                       for label in (np.ones_like(matched), matched, policy, policy & ~matched)],
                      axis=-1).astype(np.int64).reshape(groups, width, 4)
    at_group, at_slot = np.nonzero((reached > 0) | (shadow[..., 0] > 0) | (shadow_tokens > 0))
    return {**key_of(at_group), "layer": layers[at_slot], "tokens": reached[at_group, at_slot],
            "exits": exits[at_group, at_slot],
            **{name: shadow[at_group, at_slot, offset]
               for offset, name in enumerate(ROLLUP_COUNTERS[2:])},
            **{name: cost[at_group, at_slot, offset]
               for offset, name in enumerate(COST_COUNTERS[:3])},
            "shadow_tokens": shadow_tokens[at_group, at_slot]}


def _histogram(key_of: _KeyColumns, layers: np.ndarray, cell: np.ndarray,
               signal_value: np.ndarray) -> Table:
    """Signal-at-exit histogram increments: one row per non-empty (group, layer, bin).

    Tokens whose exits were not checked (NaN signal) have no signal and are left out."""
    checked = ~np.isnan(signal_value)
    bins = np.minimum((signal_value[checked] * HISTOGRAM_BINS).astype(np.int64),
                      HISTOGRAM_BINS - 1)
    counts = np.bincount(cell[checked] * HISTOGRAM_BINS + bins,
                         minlength=key_of.groups * len(layers) * HISTOGRAM_BINS)
    [filled] = np.nonzero(counts)
    at_group, rest = np.divmod(filled, len(layers) * HISTOGRAM_BINS)
    return {**key_of(at_group), "layer": layers[rest // HISTOGRAM_BINS],
            "bin": rest % HISTOGRAM_BINS, "count": counts[filled]}


def aggregate_tables(*, deployment_id: int, exit_layers: list[int], num_layers: int,
                     aggregates: list[AggregateBatch],
                     segment_of: Mapping[str, str] | None = None) -> tuple[Table, Table]:
    """(rollup increments, histogram increments) of checked aggregate batches: per (version,
    runtime, minute, segment) the exits per layer, `tokens` at a layer being the exits at or
    past it. `segment_of`: as for `tables_of` (cells it folds together add up)."""
    cells = [(batch.runtime_id, cell) for batch in aggregates for cell in batch.cells]
    layers = np.unique([*exit_layers, num_layers])
    runtimes = sorted({runtime for runtime, _ in cells})
    segment_of = segment_of or {}
    stored = [segment_of.get(cell.segment, cell.segment) for _, cell in cells]
    segments = sorted(set(stored))
    version = np.array([cell.threshold_version for _, cell in cells], dtype=np.int64)
    runtime = np.array([runtimes.index(name) for name, _ in cells], dtype=np.int64)
    minute = np.array([cell.minute for _, cell in cells], dtype=np.int64)
    number = {name: index for index, name in enumerate(segments)}
    segment = np.array([number[name] for name in stored], dtype=np.int64)
    keys, group = number_groups(version, runtime, minute, segment)
    key_of = _KeyColumns(deployment_id, keys, runtimes, segments)
    width = len(layers)
    slot = np.searchsorted(layers, [cell.layer for _, cell in cells])  # one of `layers` (checked)
    exits = np.zeros(key_of.groups * width, dtype=np.int64)
    np.add.at(exits, group * width + slot, [cell.exits for _, cell in cells])
    exits = exits.reshape(key_of.groups, width)
    reached = np.cumsum(exits[:, ::-1], axis=1)[:, ::-1]
    # What the cells' tokens cost: only cells whose every token was timed carry it.
    cost = np.zeros((key_of.groups * width, 3), dtype=np.int64)
    timed = [(index, cell) for index, (_, cell) in enumerate(cells) if cell.latency_us is not None]
    if timed:
        np.add.at(cost, (group * width + slot)[[index for index, _ in timed]],
                  np.array([(cell.exits, cell.latency_us, cell.exit_checks)
                            for _, cell in timed], dtype=np.int64))
    cost = cost.reshape(key_of.groups, width, 3)
    at_group, at_slot = np.nonzero(reached > 0)
    zeros = np.zeros(len(at_group), dtype=np.int64)
    rollups = {**key_of(at_group), "layer": layers[at_slot], "tokens": reached[at_group, at_slot],
               "exits": exits[at_group, at_slot], **dict.fromkeys(ROLLUP_COUNTERS[2:], zeros),
               **{name: cost[at_group, at_slot, offset]
                  for offset, name in enumerate(COST_COUNTERS[:3])},
               "shadow_tokens": zeros}
    counts = np.zeros(key_of.groups * width * HISTOGRAM_BINS, dtype=np.int64)
    np.add.at(counts, ((group * width + slot)[:, None] * HISTOGRAM_BINS
                       + np.arange(HISTOGRAM_BINS)).ravel(),
              np.array([cell.histogram for _, cell in cells], dtype=np.int64).ravel())
    [filled] = np.nonzero(counts)
    at_group, rest = np.divmod(filled, width * HISTOGRAM_BINS)
    histogram = {**key_of(at_group), "layer": layers[rest // HISTOGRAM_BINS],
                 "bin": rest % HISTOGRAM_BINS, "count": counts[filled]}
    return rollups, histogram


def merge_counts(tables: list[Table], counters: tuple[str, ...]) -> Table:
    """One table of distinct keys in key order, summing `counters` over tables with the same
    columns (keys: every other column), so one transaction writes each rollup row once."""
    filled = [table for table in tables if len(table["layer"])]
    if len(filled) <= 1:
        return filled[0] if filled else tables[0]
    keys = [name for name in filled[0] if name not in counters]
    text = {name for name in keys if isinstance(filled[0][name], list)}
    joined = {name: np.concatenate([np.asarray(table[name], dtype=str if name in text else None)
                                    for table in filled]) for name in filled[0]}
    values, group = number_groups(*(joined[name] for name in keys))
    out: Table = {name: value.tolist() if name in text else value
                  for name, value in zip(keys, values, strict=True)}
    for counter in counters:
        total = np.zeros(len(values[0]), dtype=np.int64)
        np.add.at(total, group, joined[counter].astype(np.int64))
        out[counter] = total
    return out


@dataclass(frozen=True)
class _KeyColumns:
    """Rollup key columns before `layer` for group numbers (keys: version, runtime index,
    minute, segment index)."""

    deployment_id: int
    keys: list[np.ndarray]
    runtimes: list[str]
    segments: list[str]

    @property
    def groups(self) -> int:
        return len(self.keys[0])

    def __call__(self, group: np.ndarray) -> Table:
        version, runtime, minute, segment = (key[group] for key in self.keys)
        return {"deployment_id": np.full(len(group), self.deployment_id), "version": version,
                "runtime_id": [self.runtimes[number] for number in runtime.tolist()],
                "minute": minute.astype("datetime64[s]"),
                "segment": _names(self.segments, segment)}
