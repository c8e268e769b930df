"""Telemetry ingestion and reads: plain keyword-only functions over the store.

A batch is checked whole before anything is written; it is stored in one transaction together
with its rollups, and its id makes a replay a no-op. Ingestion works on columns (see
columns.py and tables.py); PostgreSQL gets binary COPY for the raw rows. Each batch's traffic
segments go through the deployment's cap where the batch is written (admission.py).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import numpy as np
from sqlalchemy import delete, func, select, text
from sqlalchemy.orm import Session

from controlplane.db import dialect_insert
from controlplane.deployments.models import Deployment, ThresholdSet, UndeclaredSegmentTokens
from controlplane.errors import Invalid
from controlplane.runtimes.lineage import note_batches
from controlplane.runtimes.witnesses import token_of, witness_labels, witness_of
from controlplane.telemetry import bulk, shadow_requests
from controlplane.telemetry.admission import check_segment_names, note_undeclared, stored_segments
from controlplane.telemetry.columns import BatchColumns
from controlplane.telemetry.models import (
    HISTOGRAM_BINS,
    PARTITIONED_TABLES,
    Rollup,
    RollupHistogram,
    ShadowRequestRow,
    ShadowRequestTokenRow,
    ShadowSampleRow,
    TelemetryBatchRow,
    TokenRecordRow,
)
from controlplane.telemetry.tables import (
    ROLLUP_COUNTERS,
    STORED_COUNTERS,
    VersionThresholds,
    aggregate_tables,
    merge_counts,
    tables_of,
)
from controlplane.telemetry.trust import trusted
from exitplane.wire import DEFAULT_SEGMENT, AggregateBatch, IntervalBatch, TelemetryBatch

if TYPE_CHECKING:
    from controlplane.deployments.cache import CachedDeployment

log = logging.getLogger("exitplane.telemetry")


class BadRecord(Invalid):
    """A batch refused because of one record; `index` points at the first bad one."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(f"record {index}: {message}")
        self.index = index

    @property
    def extra(self) -> dict:
        return {"index": self.index}


@dataclass(frozen=True)
class IngestResult:
    batch_id: str
    accepted: int  # records, or for an aggregate batch the tokens it counts
    duplicate: bool
    aggregate: bool = False
    overflow: int = 0  # of its tokens, those stored as `default`, past the segment cap
    records: int = 0  # records stored as rows (0 for a replay)
    # What its tokens cost (0 for a replay): timed tokens, their wall time, layers saved.
    timed_tokens: int = 0
    wall_us: int = 0
    layers_saved: int = 0


def check_batch(*, deployment: Deployment | CachedDeployment, batch: BatchColumns,
                known_versions: set[int], latest: float | None = None) -> None:
    """Refuse the whole batch (BadRecord / Invalid) unless every record fits the deployment
    and, with `latest` (unix seconds), none is timed after it."""
    if latest is not None and len(batch.ts) and batch.ts.max() > latest:
        index = int(np.argmax(batch.ts > latest))
        raise BadRecord(index, _ahead(f"ts {float(batch.ts[index])}", batch.ts[index], latest))
    if batch.deployment != deployment.name:
        raise Invalid(f"batch is for deployment {batch.deployment!r}, not {deployment.name!r}")
    if batch.num_layers != deployment.num_layers:
        raise Invalid(f"batch says num_layers {batch.num_layers}; deployment "
                      f"{deployment.name!r} has {deployment.num_layers}")
    check_segment_names(set(batch.segment))
    exit_layers = set(deployment.exit_layers)
    bad = ~np.isin(batch.exit_layer, [*exit_layers, deployment.num_layers])
    bad |= ~np.isin(batch.threshold_version, list(known_versions))
    # A shadow covers exactly the exit layers: as many points, none elsewhere (none repeats).
    points = np.bincount(batch.shadow_owner, minlength=len(batch.shadowed))
    stray = np.bincount(batch.shadow_owner, minlength=len(batch.shadowed),
                        weights=~np.isin(batch.shadow_layer, list(exit_layers)))
    bad[batch.shadowed] |= (points != len(exit_layers)) | (stray > 0)
    # A shadow token runs to full depth (its points label every exit layer against it).
    deep = batch.exit_layer[batch.shadowed] == deployment.num_layers
    bad[batch.shadowed] |= ~deep
    if not bad.any():
        return
    index = int(np.argmax(bad))
    exit_layer, version = int(batch.exit_layer[index]), int(batch.threshold_version[index])
    if exit_layer not in exit_layers and exit_layer != deployment.num_layers:
        raise BadRecord(index, f"exit_layer {exit_layer} is neither an exit layer "
                               f"{sorted(exit_layers)} nor full depth {deployment.num_layers}")
    if version not in known_versions:
        raise BadRecord(index, f"threshold_version {version} was never published for "
                               f"{deployment.name!r}")
    covered = (points == len(exit_layers)) & (stray == 0)
    if index in set(batch.shadowed[covered & ~deep].tolist()):
        raise BadRecord(index, f"a shadow token runs to full depth: its exit_layer must be "
                               f"{deployment.num_layers}, not {exit_layer} (a token that "
                               f"exited early carries no shadow)")
    raise BadRecord(index, f"shadow points must cover exactly the exit layers "
                           f"{sorted(exit_layers)}")


def _ahead(what: str, when: float, latest: float) -> str:
    return (f"{what} is {float(when) - latest:.0f} s past the latest time the control plane "
            f"takes now ({latest:.0f}: its clock + EXITPLANE_TELEMETRY_MAX_FUTURE_S); check "
            f"the runtime's clock")


def check_aggregate(*, deployment: Deployment | CachedDeployment, batch: AggregateBatch,
                    known_versions: set[int], latest: float | None = None) -> None:
    """Refuse the whole aggregate batch (Invalid, naming the first bad cell) unless every cell
    is at an exit layer or full depth and under a published version, and, with `latest`
    (unix seconds), none counts a minute that starts after it."""
    if batch.deployment != deployment.name:
        raise Invalid(f"batch is for deployment {batch.deployment!r}, not {deployment.name!r}")
    if batch.num_layers != deployment.num_layers:
        raise Invalid(f"batch says num_layers {batch.num_layers}; deployment "
                      f"{deployment.name!r} has {deployment.num_layers}")
    check_segment_names(segment_names(batch))
    layers = {*deployment.exit_layers, deployment.num_layers}
    for index, cell in enumerate(batch.cells):
        if latest is not None and cell.minute > latest:
            raise Invalid(f"cell {index}: " + _ahead(f"minute {cell.minute}", cell.minute,
                                                     latest))
        if cell.layer not in layers:
            raise Invalid(f"cell {index}: layer {cell.layer} is neither an exit layer "
                          f"{sorted(deployment.exit_layers)} nor full depth "
                          f"{deployment.num_layers}")
        if cell.threshold_version not in known_versions:
            raise Invalid(f"cell {index}: threshold_version {cell.threshold_version} was never "
                          f"published for {deployment.name!r}")


def ingest(*, session: Session, deployment: Deployment | CachedDeployment,
           batches: Sequence[BatchColumns | TelemetryBatch | AggregateBatch],
           thresholds: dict[int, np.ndarray] | None = None,
           witnesses: Sequence[str] | None = None) -> list[IngestResult]:
    """Store checked batches (records and aggregates) of one deployment with their rollups, in
    the caller's transaction; replays are skipped.

    `thresholds`: what `thresholds_by_version` gave for these batches, if the caller has it.
    `witnesses`: who vouches for each batch (`runtimes.witnesses`: the token that posted it);
    None: each batch's runtime id (a writer that holds no credential)."""
    if not batches:
        return []
    batches = [batch if isinstance(batch, BatchColumns | AggregateBatch)
               else BatchColumns.from_model(batch) for batch in batches]
    if witnesses is None:
        witnesses = [witness_of(token_id=None, runtime_id=b.runtime_id) for b in batches]
    if len(witnesses) != len(batches):
        raise ValueError(f"{len(witnesses)} witnesses for {len(batches)} batches")
    witness_of_batch = {b.batch_id: w for b, w in zip(batches, witnesses, strict=True)}
    # Segment admission comes first: registering a name locks the deployment row, which must
    # not wait on (and be waited on by) the key-share locks the batch rows' foreign keys take.
    # A replay's names may be decided again: its rows are not written twice.
    segment_of = _segments_stored(session=session, deployment=deployment, batches=batches)
    new_ids = _claim_batches(session=session, deployment=deployment, batches=batches,
                             witness_of_batch=witness_of_batch)
    # Stored and shown whatever lineage they report; one that differs marks its runtime.
    note_batches(session=session, deployment_id=deployment.id,
                 batches=[b for b in batches if b.batch_id in new_ids])
    fresh = [b for b in batches if b.batch_id in new_ids and isinstance(b, BatchColumns)]
    aggregates = [b for b in batches if b.batch_id in new_ids and isinstance(b, AggregateBatch)]
    # An interval batch's records are stored as the aggregated record batch they stand for.
    carried = {b.batch_id: BatchColumns.of_interval(b) for b in aggregates
               if isinstance(b, IntervalBatch) and b.records is not None}
    fresh += carried.values()
    rollups, histograms = [], []
    if fresh:
        versions = set(np.unique(np.concatenate([b.threshold_version for b in fresh])).tolist())
        if thresholds is None or not versions <= thresholds.keys():
            thresholds = thresholds_by_version(session=session, deployment=deployment,
                                               versions=versions)
        tables = tables_of(deployment_id=deployment.id, exit_layers=deployment.exit_layers,
                           num_layers=deployment.num_layers, batches=fresh,
                           thresholds=thresholds, segment_of=segment_of,
                           witnesses=[witness_of_batch[b.batch_id] for b in fresh])
        bulk.write_rows(session, TokenRecordRow, tables.tokens)
        if len(tables.shadows["idx"]):
            bulk.write_rows(session, ShadowSampleRow, tables.shadows)
            shadow_requests.stage(session=session, deployment_id=deployment.id,
                                  exit_layers=deployment.exit_layers, batches=fresh,
                                  witnesses=witness_of_batch, segment_of=segment_of)
        rollups.append(tables.rollups)
        histograms.append(tables.histogram)
    if aggregates:
        rollup, histogram = aggregate_tables(
            deployment_id=deployment.id, exit_layers=deployment.exit_layers,
            num_layers=deployment.num_layers, aggregates=aggregates, segment_of=segment_of)
        rollups.append(rollup)
        histograms.append(histogram)
    if rollups:
        # One sorted write per table: concurrent writers lock rows in one order.
        bulk.add_counts(session, Rollup, merge_counts(rollups, STORED_COUNTERS),
                        STORED_COUNTERS)
        bulk.add_counts(session, RollupHistogram, merge_counts(histograms, ("count",)),
                        ("count",))
    overflow = {b.batch_id: overflow_tokens(b, segment_of) for b in batches
                if b.batch_id in new_ids}
    if segment_of:
        _count_undeclared(session=session, deployment=deployment, segment_of=segment_of,
                          batches=[b for b in batches if b.batch_id in new_ids],
                          overflow=overflow)
    session.flush()
    return [IngestResult(batch_id=b.batch_id, accepted=accounted(b),
                         duplicate=b.batch_id not in new_ids,
                         **(cost_counts(b, deployment.num_layers) if b.batch_id in new_ids
                            else {}),
                         aggregate=isinstance(b, AggregateBatch),
                         overflow=overflow.get(b.batch_id, 0),
                         records=(len(carried[b.batch_id]) if b.batch_id in carried
                                  else len(b) if isinstance(b, BatchColumns)
                                  and b.batch_id in new_ids else 0))
            for b in batches]


def segment_names(batch: BatchColumns | AggregateBatch) -> set[str]:
    """The distinct segment names `batch` carries (its cells' and records')."""
    if not isinstance(batch, AggregateBatch):
        return set(batch.segment)  # C-level
    names = {cell.segment for cell in batch.cells}
    if isinstance(batch, IntervalBatch) and batch.records is not None:
        names.update(batch.records.segment or ())
    return names


def _segments_stored(*, session: Session, deployment: Deployment | CachedDeployment,
                     batches: list[BatchColumns | AggregateBatch]) -> dict[str, str]:
    """The names in `batches` that the deployment does not have in use, stored as `default`
    (-> 'default'); names stored as themselves are left out (nothing to map)."""
    names: set[str] = set()
    for batch in batches:
        carried = segment_names(batch)
        check_segment_names(carried)  # checked before queueing too; a worker checks again
        names |= carried
    if not names - {DEFAULT_SEGMENT}:
        return {}
    decided = stored_segments(session=session, deployment_id=deployment.id, names=names)
    return {name: stored for name, stored in decided.items() if stored != name}


def _count_undeclared(*, session: Session, deployment: Deployment | CachedDeployment,
                      segment_of: dict[str, str], batches: list[BatchColumns | AggregateBatch],
                      overflow: dict[str, int]) -> None:
    """Count, per runtime in this minute, the new batches' tokens stored as `default` because
    their segment is not in use (and the batches), and have them logged after the commit."""
    by_runtime: dict[str, list[int]] = {}
    for batch in batches:
        folded = segment_names(batch) & segment_of.keys()
        if folded:
            counts = by_runtime.setdefault(batch.runtime_id, [0, 0])
            counts[0] += overflow[batch.batch_id]
            counts[1] += 1
            note_undeclared(session=session, deployment_id=deployment.id, names=folded,
                            tokens=overflow[batch.batch_id])
    if not by_runtime:
        return
    runtimes = sorted(by_runtime)
    minute = np.datetime64(int(datetime.now(UTC).timestamp()) // 60 * 60, "s")
    bulk.add_counts(session, UndeclaredSegmentTokens, {
        "deployment_id": np.full(len(runtimes), deployment.id), "runtime_id": runtimes,
        "minute": np.full(len(runtimes), minute),
        "tokens": np.array([by_runtime[r][0] for r in runtimes], dtype=np.int64),
        "batches": np.array([by_runtime[r][1] for r in runtimes], dtype=np.int64)},
        ("tokens", "batches"))


def overflow_tokens(batch: BatchColumns | AggregateBatch, segment_of: dict[str, str]) -> int:
    """Tokens of `batch` stored as `default` because their segment was past the cap. A
    sampled record batch counts none: its tokens are counted by the runtime's aggregate
    batches, whose cells were relabelled the same way."""
    if not segment_of:
        return 0
    if isinstance(batch, AggregateBatch):
        return sum(cell.exits for cell in batch.cells if cell.segment in segment_of)
    if batch.aggregated:
        return 0
    return sum(1 for name in batch.segment if name in segment_of)


def cost_counts(batch: BatchColumns | AggregateBatch, num_layers: int) -> dict[str, int]:
    """What the tokens a batch adds to the rollups cost: timed tokens, their wall time
    (microseconds), and the layers non-shadow tokens skipped. A sampled record batch adds
    none (its runtime's aggregate cells count its tokens)."""
    if isinstance(batch, AggregateBatch):
        timed = [cell for cell in batch.cells if cell.latency_us is not None]
        return {"timed_tokens": sum(cell.exits for cell in timed),
                "wall_us": sum(cell.latency_us for cell in timed),
                "layers_saved": sum((num_layers - cell.layer) * cell.exits
                                    for cell in batch.cells)}
    if batch.aggregated:
        return {}
    timed = batch.exit_checks >= 0
    skipped = num_layers - batch.exit_layer
    skipped[batch.shadowed] = 0
    return {"timed_tokens": int(timed.sum()), "wall_us": int(batch.latency_us[timed].sum()),
            "layers_saved": int(skipped.sum())}


def accounted(batch: BatchColumns | AggregateBatch) -> int:
    """Records a record batch carries, tokens an aggregate batch counts."""
    return batch.tokens if isinstance(batch, AggregateBatch) else len(batch)


def _batch_row(batch: BatchColumns | AggregateBatch) -> dict:
    """The telemetry_batches columns that say what a batch carried."""
    if isinstance(batch, AggregateBatch):
        return {"records": len(batch.cells), "kind": "aggregate", "tokens": batch.tokens,
                "raw_sample_rate": batch.raw_sample_rate}
    if batch.aggregated:
        return {"records": len(batch), "kind": "sampled", "tokens": 0, "raw_sample_rate": None}
    return {"records": len(batch), "kind": "records", "tokens": len(batch),
            "raw_sample_rate": None}


def _claim_batches(*, session: Session, deployment: Deployment | CachedDeployment,
                   batches: list[BatchColumns | AggregateBatch],
                   witness_of_batch: dict[str, str]) -> set[str]:
    """Insert batch ids that are new to the deployment; return those (a replayed id is not
    returned; another deployment's batch with the same id is no replay)."""
    seen: set[str] = set()
    unique = []
    for batch in batches:
        if batch.batch_id not in seen:
            seen.add(batch.batch_id)
            unique.append(batch)
    values = [{"batch_id": b.batch_id, "deployment_id": deployment.id,
               "runtime_id": b.runtime_id, "seq": b.seq, **_batch_row(b),
               "token_id": token_of(witness_of_batch[b.batch_id]),
               "received_at": datetime.now(UTC)} for b in unique]
    statement = dialect_insert(session, TelemetryBatchRow)
    statement = statement.on_conflict_do_nothing(index_elements=["deployment_id", "batch_id"])
    # executemany: one compiled (cached) statement whatever the number of batches.
    return set(session.scalars(statement.returning(TelemetryBatchRow.batch_id), values))


def thresholds_by_version(*, session: Session, deployment: Deployment | CachedDeployment,
                          versions: Iterable[int]) -> VersionThresholds:
    """Thresholds in exit-layer order of those `versions` that exist: the published ones, and
    0, the runtime's built-in never-exit set; with each version's per-segment maps."""
    layers = deployment.exit_layers

    def ordered(by_layer: dict) -> np.ndarray:
        by_layer = {int(layer): float(value) for layer, value in by_layer.items()}
        return np.array([by_layer[k] for k in layers])

    found = VersionThresholds({0: np.ones(len(layers))})
    rows = session.execute(select(ThresholdSet.version, ThresholdSet.thresholds,
                                  ThresholdSet.segments).where(
        ThresholdSet.deployment_id == deployment.id, ThresholdSet.version.in_(set(versions))))
    for version, thresholds, segments in rows:
        found[version] = ordered(thresholds)
        for name, by_layer in (segments or {}).items():
            found.segments[(version, name)] = ordered(by_layer)
    return found


# -- reads -------------------------------------------------------------------------------------

def exit_rates(*, session: Session, deployment: Deployment, since: datetime,
               until: datetime | None = None, version: int | None = None,
               runtime_id: str | None = None, segment: str | None = None,
               exclude: Collection[str] = ()) -> list[dict]:
    """Per minute and layer: tokens checked, exits, exit rate, shadow labels, disagreement
    (of one traffic segment when `segment` is given, else summed over all; without the
    runtimes in `exclude`)."""
    query = (select(Rollup.minute, Rollup.layer, *[func.sum(getattr(Rollup, c)).label(c)
                                                    for c in ROLLUP_COUNTERS])
             .where(Rollup.deployment_id == deployment.id, Rollup.minute >= since)
             .group_by(Rollup.minute, Rollup.layer).order_by(Rollup.minute, Rollup.layer))
    query = _filters(query, Rollup, until, version, runtime_id, segment, exclude)
    out = []
    for row in session.execute(query):
        item = {"minute": row.minute, "layer": row.layer,
                **{c: int(getattr(row, c)) for c in ROLLUP_COUNTERS}}
        item["exit_rate"] = item["exits"] / item["tokens"] if item["tokens"] else None
        out.append(item)
    return out


def disagreement(*, session: Session, deployment: Deployment, since: datetime,
                 until: datetime | None = None, version: int | None = None,
                 runtime_id: str | None = None, segment: str | None = None) -> list[dict]:
    """Per minute: shadow tokens and how many the applied policy would have answered wrong."""
    first = deployment.exit_layers[0]
    query = (select(Rollup.minute, func.sum(Rollup.shadow_total).label("shadow_tokens"),
                    func.sum(Rollup.policy_mismatches).label("mismatches"))
             .where(Rollup.deployment_id == deployment.id, Rollup.minute >= since)
             .group_by(Rollup.minute).order_by(Rollup.minute))
    query = _filters(query, Rollup, until, version, runtime_id, segment)
    # shadow_total counts a shadow token once per exit layer; the first layer counts it once.
    per_minute = {row.minute: int(row.mismatches) for row in session.execute(query)}
    totals = session.execute(
        _filters(select(Rollup.minute, func.sum(Rollup.shadow_total).label("n"))
                 .where(Rollup.deployment_id == deployment.id, Rollup.minute >= since,
                        Rollup.layer == first).group_by(Rollup.minute), Rollup, until, version,
                 runtime_id, segment))
    out = []
    for row in totals:
        n = int(row.n)
        mismatches = per_minute.get(row.minute, 0)
        out.append({"minute": row.minute, "shadow_tokens": n, "mismatches": mismatches,
                    "disagreement": mismatches / n if n else None})
    return sorted(out, key=lambda item: item["minute"])


def signal_histogram(*, session: Session, deployment: Deployment, since: datetime,
                     until: datetime | None = None, version: int | None = None,
                     runtime_id: str | None = None, segment: str | None = None,
                     exclude: Collection[str] = ()) -> dict[int, list[int]]:
    """Per exit layer (and full depth): counts of the signal at exit in 20 bins over [0, 1]
    (without the runtimes in `exclude`)."""
    query = (select(RollupHistogram.layer, RollupHistogram.bin,
                    func.sum(RollupHistogram.count).label("n"))
             .where(RollupHistogram.deployment_id == deployment.id,
                    RollupHistogram.minute >= since)
             .group_by(RollupHistogram.layer, RollupHistogram.bin))
    query = _filters(query, RollupHistogram, until, version, runtime_id, segment, exclude)
    out: dict[int, list[int]] = {}
    for row in session.execute(query):
        out.setdefault(row.layer, [0] * HISTOGRAM_BINS)[row.bin] = int(row.n)
    return dict(sorted(out.items()))


def _filters(query, model, until, version, runtime_id, segment=None, exclude=()):
    if exclude:
        query = query.where(model.runtime_id.not_in(sorted(exclude)))
    if segment is not None:
        query = query.where(model.segment == segment)
    if until is not None:
        query = query.where(model.minute < until)
    if version is not None:
        query = query.where(model.version == version)
    if runtime_id is not None:
        query = query.where(model.runtime_id == runtime_id)
    return query


@dataclass(frozen=True)
class ShadowEvidence:
    """A window's shadow tokens in exit-layer order, oldest first, with where each came from."""

    requests: list[str]  # request id (a sample stored without one: its batch id)
    runtimes: list[str]  # the runtime that reported it
    signals: np.ndarray  # (n, L) float32
    matched: np.ndarray  # (n, L) bool
    times: np.ndarray  # (n,) epoch seconds (empty unless asked for)
    # who vouches for each sample: the credential that posted it (`runtimes.witnesses`); the
    # robust rules count these, never the runtime ids
    witnesses: list[str] = field(default_factory=list)

    def keyed_requests(self) -> np.ndarray:
        """Request ids keyed by their runtime: one runtime's ids never join another's
        request (the statistics cluster by request, the robust checks split by runtime)."""
        return np.array([f"{runtime}/{request}" for runtime, request
                         in zip(self.runtimes, self.requests, strict=True)], dtype=str)


def shadow_evidence(*, session: Session, deployment: Deployment, since: datetime,
                    until: datetime | None = None, version: int | None = None,
                    limit: int = 1_000_000, segment: str | None = None,
                    exclude: Collection[str] | None = None, with_times: bool = False,
                    exclude_witnesses: Collection[str] | None = None) -> ShadowEvidence:
    """The one read of shadow samples every decision uses: with request, runtime and witness
    ids, and without the runtimes in `exclude` (None: the deployment's excluded runtimes, set
    aside as outliers or serving other heads or another model: `runtimes.outliers.
    excluded_runtime_ids`; () reads every runtime) and the witnesses in `exclude_witnesses`
    (None: those set aside, `runtimes.outliers.excluded_witnesses`; () none)."""
    return _read_shadow(session=session, deployment=deployment, since=since, until=until,
                        version=version, limit=limit, with_times=with_times, segment=segment,
                        exclude=exclude, exclude_witnesses=exclude_witnesses)


def shadow_samples(*, session: Session, deployment: Deployment, since: datetime,
                   until: datetime | None = None, version: int | None = None,
                   limit: int = 1_000_000, segment: str | None = None,
                   exclude: Collection[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(signals float32 (n, L), matched bool (n, L)) in exit-layer order, oldest first (of one
    traffic segment when `segment` is given; `exclude` as for `shadow_evidence`)."""
    found = _read_shadow(session=session, deployment=deployment, since=since, until=until,
                         version=version, limit=limit, segment=segment, exclude=exclude)
    return found.signals, found.matched


def raw_sample_rate(*, session: Session, deployment: Deployment,
                    within: timedelta = timedelta(hours=1)) -> float | None:
    """The share of non-shadow tokens runtimes ship as records, from the latest aggregate
    batch received `within` (None: no runtime aggregated lately, every token is a record)."""
    return session.scalar(
        select(TelemetryBatchRow.raw_sample_rate)
        .where(TelemetryBatchRow.deployment_id == deployment.id,
               TelemetryBatchRow.kind == "aggregate",
               TelemetryBatchRow.received_at >= datetime.now(UTC) - within)
        .order_by(TelemetryBatchRow.received_at.desc()).limit(1))


def shadow_samples_by_request(*, session: Session, deployment: Deployment, since: datetime,
                              until: datetime | None = None, version: int | None = None,
                              limit: int = 1_000_000, segment: str | None = None,
                              exclude: Collection[str] | None = None
                              ) -> tuple[list[str], np.ndarray, np.ndarray]:
    """`shadow_samples` with each sample's request id (tests cluster tokens by request).

    Samples stored before request ids were kept stand for their batch (a conservative cluster)."""
    found = _read_shadow(session=session, deployment=deployment, since=since, until=until,
                         version=version, limit=limit, segment=segment, exclude=exclude)
    return found.requests, found.signals, found.matched


def timed_shadow_samples_by_request(*, session: Session, deployment: Deployment,
                                    since: datetime, version: int | None = None,
                                    limit: int = 1_000_000, segment: str | None = None,
                                    exclude: Collection[str] | None = None
                                    ) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """`shadow_samples_by_request` plus each sample's time (epoch seconds, float64): the drift
    check tests sub-windows of the samples it read."""
    found = _read_shadow(session=session, deployment=deployment, since=since, until=None,
                         version=version, limit=limit, with_times=True, segment=segment,
                         exclude=exclude)
    return found.requests, found.signals, found.matched, found.times


def _read_shadow(*, session: Session, deployment: Deployment, since: datetime,
                 until: datetime | None, version: int | None, limit: int,
                 with_times: bool = False, segment: str | None = None,
                 exclude: Collection[str] | None = None,
                 exclude_witnesses: Collection[str] | None = None) -> ShadowEvidence:
    """One read of the shadow samples, oldest first, with request, runtime and witness ids;
    times only when asked for (the column costs); the runtimes in `exclude` and the witnesses
    in `exclude_witnesses` left out (None: the deployment's excluded ones).

    A window holding more than `limit` samples gives its newest `limit`: a fleet ships ~10,000
    shadow tokens a second, and the consumers (the drift check's sliding windows, recalibration
    after a shift, the fallback's recheck) need the latest evidence, never the window's first
    seconds. Truncating by time is independent of the outcomes, so the tests stay valid on what
    was read."""
    columns = [ShadowSampleRow.signals, ShadowSampleRow.matched, ShadowSampleRow.runtime_id,
               ShadowSampleRow.witness]
    if with_times:
        columns.append(ShadowSampleRow.ts)
    columns.append(func.coalesce(ShadowSampleRow.request_id,
                                 ShadowSampleRow.batch_id).label("request_id"))
    query = (select(*columns)
             .where(ShadowSampleRow.deployment_id == deployment.id, ShadowSampleRow.ts >= since)
             .order_by(ShadowSampleRow.ts.desc()).limit(limit))
    if until is not None:
        query = query.where(ShadowSampleRow.ts < until)
    if version is not None:
        query = query.where(ShadowSampleRow.threshold_version == version)
    if segment is not None:
        query = query.where(ShadowSampleRow.segment == segment)
    query = trusted(query, ShadowSampleRow, session=session, deployment_id=deployment.id,
                    exclude=exclude, exclude_witnesses=exclude_witnesses)
    # Core rows, columns transposed once: the ORM's per-row loading cost more than the read
    # itself at 200,000 rows (a drift check at fleet rates).
    rows = session.connection().execute(query).all()
    width = len(deployment.exit_layers)
    if not rows:
        return ShadowEvidence([], [], np.zeros((0, width), dtype=np.float32),
                              np.zeros((0, width), dtype=bool), np.zeros(0), [])
    columns = list(zip(*reversed(rows), strict=True))
    signals = np.frombuffer(b"".join(map(bytes, columns[0])), dtype="<f4")
    matched = np.frombuffer(b"".join(map(bytes, columns[1])), dtype=np.uint8)
    # naive datetimes (SQLite) are UTC, as everything this store writes
    times = np.array([(ts if ts.tzinfo else ts.replace(tzinfo=UTC)).timestamp()
                      for ts in columns[4]]) if with_times else np.zeros(0)
    return ShadowEvidence(list(columns[-1]), list(columns[2]),
                          signals.reshape(-1, width).copy(),
                          matched.reshape(-1, width).astype(bool), times,
                          witness_labels(columns[3], columns[2]).tolist())


def counts(*, session: Session, deployment: Deployment) -> dict:
    """Rows stored, tokens counted in the rollups, and whether per-token records are sampled
    (an aggregating runtime ships only shadow tokens and a share of the rest as records)."""
    records = session.scalar(select(func.count()).select_from(TokenRecordRow)
                             .where(TokenRecordRow.deployment_id == deployment.id))
    batches = dict(session.execute(
        select(TelemetryBatchRow.kind, func.count()).where(
            TelemetryBatchRow.deployment_id == deployment.id).group_by(TelemetryBatchRow.kind)
    ).all())
    shadow = session.scalar(select(func.count()).select_from(ShadowSampleRow)
                            .where(ShadowSampleRow.deployment_id == deployment.id))
    # Every token reaches the first layer of the rollups (the lowest exit layer).
    lowest = min([*deployment.exit_layers, deployment.num_layers])
    tokens = session.scalar(select(func.coalesce(func.sum(Rollup.tokens), 0)).where(
        Rollup.deployment_id == deployment.id, Rollup.layer == lowest))
    rate = raw_sample_rate(session=session, deployment=deployment)
    return {"records": int(records or 0), "batches": sum(batches.values()),
            "shadow_samples": int(shadow or 0), "tokens": int(tokens or 0),
            "aggregate_batches": int(batches.get("aggregate", 0)),
            "records_sampled": bool(batches.get("aggregate") or batches.get("sampled")),
            "raw_sample_rate": rate}


# -- retention ---------------------------------------------------------------------------------

def ensure_partitions(*, session: Session, day: datetime | None = None,
                      days_ahead: int = 2) -> None:
    """PostgreSQL: create the daily partitions from `day` to `days_ahead` days later."""
    if session.get_bind().dialect.name != "postgresql":
        return
    start = (day or datetime.now(UTC)).date()
    for offset in range(days_ahead + 1):
        first = start + timedelta(days=offset)
        for parent in PARTITIONED_TABLES:
            name = f"{parent}_p{first:%Y%m%d}"
            savepoint = session.begin_nested()
            try:
                session.execute(text(
                    f"CREATE TABLE IF NOT EXISTS {name} PARTITION OF {parent} "
                    f"FOR VALUES FROM ('{first}') TO ('{first + timedelta(days=1)}')"))
                savepoint.commit()
            except Exception as error:  # e.g. that day's rows already sit in the default
                savepoint.rollback()
                log.warning("partition %s not created: %s", name, error)


def purge(*, session: Session, older_than: datetime) -> dict[str, int]:
    """Delete raw records, shadow samples and rollups older than `older_than`.

    On PostgreSQL whole daily partitions before that day are dropped first (cheap); rows left
    in other partitions are deleted."""
    dropped = 0
    if session.get_bind().dialect.name == "postgresql":
        for parent in PARTITIONED_TABLES:
            names = session.scalars(text(
                "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                "JOIN pg_class p ON p.oid = i.inhparent WHERE p.relname = :parent"),
                {"parent": parent})
            for name in list(names):
                suffix = name.removeprefix(f"{parent}_p")
                if suffix.isdigit() and len(suffix) == 8:
                    day_end = datetime.strptime(suffix, "%Y%m%d").replace(tzinfo=UTC) + \
                        timedelta(days=1)
                    if day_end <= older_than:
                        session.execute(text(f"DROP TABLE {name}"))
                        dropped += 1
    deleted = {}
    for model in (TokenRecordRow, ShadowSampleRow, ShadowRequestRow, ShadowRequestTokenRow):
        deleted[model.__tablename__] = session.execute(
            delete(model).where(model.ts < older_than)).rowcount
    deleted[ShadowRequestTokenRow.__tablename__] += shadow_requests.expire(session=session)
    shadow_requests.assemble_all(session=session)
    for model in (Rollup, RollupHistogram, UndeclaredSegmentTokens):
        deleted[model.__tablename__] = session.execute(
            delete(model).where(model.minute < older_than)).rowcount
    session.execute(delete(TelemetryBatchRow).where(TelemetryBatchRow.received_at < older_than))
    session.flush()
    return {"partitions_dropped": dropped, **deleted}

