"""Thin routes: telemetry ingestion and the reads dashboards and workers use."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Annotated, Protocol

import msgpack
import redis
from anyio import to_thread
from fastapi import APIRouter, Depends, Query, Request, status
from pydantic import ValidationError

from controlplane import metrics
from controlplane.auth.service import Principal
from controlplane.db import SessionDep
from controlplane.deployments.access import RuntimePrincipal, visible_deployment
from controlplane.deployments.service import get_deployment
from controlplane.errors import (
    RUNTIME_ERRORS,
    BatchTooLarge,
    DomainError,
    Invalid,
    error_answer,
)
from controlplane.runtimes import service as runtime_service
from controlplane.runtimes.witnesses import witness_of
from controlplane.telemetry import reads, service, stream
from controlplane.telemetry.admission import check_segment_names, names_per_batch_limit
from controlplane.telemetry.columns import BatchColumns, parse_batch
from controlplane.telemetry.schemas import (
    DisagreementPoint,
    ExitRatePoint,
    IngestAck,
    SegmentReport,
    TelemetryCounts,
)
from exitplane.kit.json_depth import TooDeep, check_json_depth
from exitplane.wire import (
    AGGREGATE_JSON,
    AGGREGATE_MSGPACK,
    INTERVAL_JSON,
    INTERVAL_MSGPACK,
    NAME_PATTERN,
    RECORDS_JSON,
    RECORDS_MSGPACK,
    AggregateBatch,
    IntervalBatch,
    TelemetryBatch,
)

router = APIRouter(tags=["telemetry"])


class UnsupportedBatchType(DomainError):
    """An exitplane content type this control plane does not know (a newer protocol)."""

    status_code = 415


# The exitplane content types and the model each body is (a plain JSON or msgpack body is a
# record batch, `TelemetryBatch`).
_BATCH_MODELS = {AGGREGATE_MSGPACK: AggregateBatch, AGGREGATE_JSON: AggregateBatch,
                 INTERVAL_MSGPACK: IntervalBatch, INTERVAL_JSON: IntervalBatch}


def batch_model(content_type: str) -> type[AggregateBatch] | None:
    """The model of a POST /v1/telemetry body by its content type: AggregateBatch,
    IntervalBatch, or None for a record batch."""
    media = content_type.split(";")[0].strip().lower()
    model = _BATCH_MODELS.get(media)
    if model is None and media.startswith("application/vnd.exitplane."):
        takes = ", ".join([RECORDS_MSGPACK, RECORDS_JSON, *_BATCH_MODELS])
        raise UnsupportedBatchType(f"content type {media!r} is not one this control plane "
                                   f"takes: {takes}")
    return model


class ValuesCharged(Protocol):
    """What a decode reports the values it builds to: the request's share of its process's
    decode budget (controlplane/guards/budgets.py: DecodeCharge), which stops the decode past
    it."""

    def values(self, count: int) -> None: ...


class _ValueCount:
    """Counts the values a msgpack decode has built (each list or map and its entries) and
    stops it past `limit`: the decoder calls `list` and `map` for every container it completes,
    so it never holds more than `limit` values and one container. With a `charge`, the values
    (map keys too) are charged to the process's decode budget as they are built. The distinct
    `segment` names of the maps (cells, records) are counted too, and past what a batch may
    carry the decode stops with the 422 the checks after it would give, before the rest is
    decoded and validated."""

    def __init__(self, limit: int, charge: ValuesCharged | None = None) -> None:
        self.limit, self.left, self.charge = limit, limit, charge
        self.segments: set[str] = set()
        self.segment_limit = names_per_batch_limit()

    def _take(self, count: int, built: int) -> None:
        self.left -= count
        if self.left < 0:
            raise _too_many(self.limit)
        if self.charge is not None:
            self.charge.values(built)

    def list(self, values: list) -> list:
        self._take(len(values) + 1, len(values) + 1)
        return values

    def map(self, entries: dict) -> dict:
        self._take(len(entries) + 1, 2 * len(entries) + 1)
        segment = entries.get("segment")
        if isinstance(segment, str) and segment not in self.segments:
            self.segments.add(segment)
            if len(self.segments) > self.segment_limit:
                check_segment_names(self.segments, self.segment_limit)
        return entries


def _too_many(limit: int) -> BatchTooLarge:
    return BatchTooLarge(f"the batch holds more than {limit} values "
                         "(EXITPLANE_TELEMETRY_MAX_BATCH_ITEMS): split it (ids <id>a and <id>b)")


def _decode(body: bytes, content_type: str, max_items: int | None,
            charge: ValuesCharged | None = None):
    """The decoded body, never more than `max_items` values (None: no bound): msgpack counts
    as it decodes; a JSON body is refused first when it could hold more (each value but a
    container's first follows a ',', so ',', '[' and '{' bound them), and one nested past
    `MAX_JSON_DEPTH` is 422 before it is decoded. With a `charge`, the values are charged to
    the decode budget: msgpack's as they are built, JSON's (keys too: ':' adds them) before
    decoding."""
    msgpacked = "msgpack" in content_type
    try:
        if msgpacked:
            if max_items is None and charge is None:
                return msgpack.unpackb(body, raw=False)
            budget = _ValueCount(max_items if max_items is not None else 1 << 62, charge)
            # One container holds at most the budget: refused on its header, before it is built.
            return msgpack.unpackb(body, raw=False, max_array_len=budget.limit,
                                   max_map_len=budget.limit, list_hook=budget.list,
                                   object_hook=budget.map)
        if max_items is not None and \
                body.count(b",") + body.count(b"[") + body.count(b"{") >= max_items:
            raise _too_many(max_items)
        check_json_depth(body)
        if charge is not None:
            charge.values(sum(map(body.count, (b",", b"[", b"{", b":"))) + 1)
        return json.loads(body)
    except TooDeep as error:
        raise Invalid(f"body {error}: a telemetry batch is at most 4 levels deep") from error
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as error:
        if max_items is not None and "exceeds max_" in str(error):  # one list or map past it
            raise _too_many(max_items) from error
        raise Invalid(f"body is not valid {'msgpack' if msgpacked else 'JSON'}: "
                      f"{error}") from error


def decode_aggregate(body: bytes, content_type: str,
                     model: type[AggregateBatch] = AggregateBatch, *,
                     max_items: int | None = None,
                     charge: ValuesCharged | None = None) -> AggregateBatch:
    """Parse and validate an aggregate (or interval) batch; the first bad cell is named."""
    try:
        return model.model_validate(_decode(body, content_type, max_items, charge))
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "batch"
        raise Invalid(f"{where}: {first['msg']}") from error


def decode_batch(body: bytes, content_type: str, *, max_items: int | None = None,
                 charge: ValuesCharged | None = None) -> BatchColumns:
    """Parse msgpack or JSON and validate the whole batch; the first bad record is named."""
    payload = _decode(body, content_type, max_items, charge)
    try:
        return parse_batch(payload)
    except ValidationError as error:
        first = error.errors()[0]
        loc = list(first["loc"])
        if len(loc) >= 2 and loc[0] == "records" and isinstance(loc[1], int):
            field = ".".join(str(part) for part in loc[2:]) or "record"
            raise service.BadRecord(loc[1], f"{field}: {first['msg']}") from error
        where = ".".join(str(part) for part in loc) or "batch"
        raise Invalid(f"{where}: {first['msg']}") from error


def _check(state, deployment, batch, aggregate: bool, known_versions) -> None:
    """Refuse the batch unless it fits the deployment (a Deployment or a cached target) and
    the API's clock (EXITPLANE_TELEMETRY_MAX_FUTURE_S)."""
    ahead = state.settings.telemetry_max_future_s
    latest = time.time() + ahead if ahead > 0 else None
    if not aggregate:
        service.check_batch(deployment=deployment, batch=batch, known_versions=known_versions,
                            latest=latest)
        return
    service.check_aggregate(deployment=deployment, batch=batch, known_versions=known_versions,
                            latest=latest)
    if isinstance(batch, IntervalBatch) and batch.records is not None:
        service.check_batch(deployment=deployment, batch=BatchColumns.of_interval(batch),
                            known_versions=known_versions, latest=latest)


def _decoded(state, body: bytes, content_type: str, charge: ValuesCharged | None = None):
    """(the batch, whether it carries token counts, the threshold versions it names)."""
    model = batch_model(content_type)
    max_items = state.settings.telemetry_max_batch_items
    if model is None:
        batch = decode_batch(body, content_type, max_items=max_items, charge=charge)
        return batch, False, batch.threshold_version.tolist()
    batch = decode_aggregate(body, content_type, model, max_items=max_items, charge=charge)
    versions = [cell.threshold_version for cell in batch.cells]
    if isinstance(batch, IntervalBatch) and batch.records is not None:
        versions += batch.records.threshold_version
    return batch, True, versions


def _fits_target(state, target, principal: Principal, batch, aggregate: bool) -> None:
    principal.require_deployment(target.id)
    _check(state, target, batch, aggregate, target.versions)


def checked_from_cache(state, principal: Principal, body: bytes, content_type: str):
    """The stream path's decode and checks against the deployment's target as this process
    has cached it, never reading the store (for the event loop): the batch, or None when the
    target or one of its versions is not cached yet, or the batch's runtime id was not found
    registered to this token lately (`store_batch` reads the store on a thread). Raises as
    `store_batch` does for a bad batch."""
    batch, aggregate, versions = _decoded(state, body, content_type)
    target = state.deployment_cache.peek(batch.deployment, versions)
    if target is None:
        return None
    _fits_target(state, target, principal, batch, aggregate)
    if _claims_runtimes(principal) and not state.runtime_claims.known(
            target.id, principal.token_id, [batch.runtime_id]):
        return None
    return batch


def _claims_runtimes(principal: Principal) -> bool:
    """Runtime tokens report only under runtime ids they registered (operators are trusted to
    write evidence for any runtime; their token is still the witness)."""
    return principal.scope == "runtime"


def claim_runtime(state, session, principal: Principal, target, batch) -> None:
    """Register the batch's runtime id to the posting runtime token, or refuse it (403) when
    another token registered it (`runtimes.service.claim_runtime_ids`), in `session`'s
    transaction."""
    if _claims_runtimes(principal):
        runtime_service.claim_runtime_ids(
            session=session, deployment=target, token_id=principal.token_id,
            runtime_ids=[batch.runtime_id],
            caps=runtime_service.RuntimeCaps.from_settings(state.settings))


def witness_of_post(principal: Principal, batch) -> str:
    """Who vouches for a posted batch: the token that posted it."""
    return witness_of(token_id=principal.token_id, runtime_id=batch.runtime_id)


def queued_ack(batch, added: bool) -> IngestAck:
    """The answer for a batch appended to the stream (or found there: a replay)."""
    metrics.queued_batches.labels(batch.deployment).inc(int(added))
    if not added:  # a replay the stream already holds: acknowledged here
        metrics.duplicate_batches.labels(batch.deployment).inc()
    return IngestAck(batch_id=batch.batch_id, accepted=service.accounted(batch),
                     duplicate=not added, queued=True)


def refused(error: DomainError) -> DomainError:
    """`error` counted as a refused batch and cut from its traceback and cause, to be raised
    again outside the `except` block that caught it: their frames hold the decoded batch (up
    to EXITPLANE_TELEMETRY_MAX_BATCH_ITEMS values) and, through the thread hand-off, sit in
    reference cycles, so it would stay in memory until a full garbage collection."""
    metrics.rejected_batches.labels(type(error).__name__).inc()
    error.__cause__ = error.__context__ = None
    return error.with_traceback(None)


def store_batch(state, principal: Principal, body: bytes, content_type: str,
                charge: ValuesCharged | None = None) -> IngestAck:
    """Check one POST /v1/telemetry body and queue it (Redis) or store it; blocking. The route
    and the fast path (controlplane/edge/telemetry_fast_path.py) both end here. `charge`: the
    request's share of the decode budget (None for a small body)."""
    try:
        return _store_batch(state, principal, body, content_type, charge)
    except DomainError as error:
        if isinstance(error, BatchTooLarge):
            state.telemetry_decodes.charge_refused(str(principal.token_id), len(body))
        refusal = refused(error)
    raise refusal from None  # here, the frames that held the batch are gone (`refused`)


def _store_batch(state, principal: Principal, body: bytes, content_type: str,
                 charge: ValuesCharged | None) -> IngestAck:
    batch, aggregate, versions = _decoded(state, body, content_type, charge)
    if state.redis is not None:
        # The stream path's checks use the cached target; the store is read only to register
        # a runtime id this process has not seen lately for this token.
        target = visible_deployment(state, principal, batch.deployment, versions)
        _fits_target(state, target, principal, batch, aggregate)
        if _claims_runtimes(principal) and not state.runtime_claims.known(
                target.id, principal.token_id, [batch.runtime_id]):
            with state.session_factory() as session:
                claim_runtime(state, session, principal, target, batch)
                session.commit()
            state.runtime_claims.remember(target.id, principal.token_id, [batch.runtime_id])
        added = stream.append(state.redis, batch, _as_sent(body, content_type),
                              witness=witness_of_post(principal, batch))
        return queued_ack(batch, added)
    visible_deployment(state, principal, batch.deployment)  # a runtime token's 403 first
    with state.session_factory() as session:
        deployment = get_deployment(session=session, name=batch.deployment)
        principal.require_deployment(deployment.id)
        thresholds = service.thresholds_by_version(
            session=session, deployment=deployment, versions=versions)
        _check(state, deployment, batch, aggregate, set(thresholds))
        claim_runtime(state, session, principal, deployment, batch)
        [result] = service.ingest(session=session, deployment=deployment, batches=[batch],
                                  thresholds=thresholds,
                                  witnesses=[witness_of_post(principal, batch)])
        session.commit()
    counter = metrics.duplicate_batches if result.duplicate else metrics.ingested_batches
    counter.labels(batch.deployment).inc()
    if not result.duplicate:
        metrics.ingested_records.labels(batch.deployment).inc(result.records)
    if not result.duplicate:  # the series exists at 0 first: a rate over it sees the first
        metrics.segment_overflow_tokens.labels(batch.deployment).inc(result.overflow)
        metrics.count_costs(batch.deployment, timed=result.timed_tokens,
                            wall_us=result.wall_us, layers=result.layers_saved)
    return IngestAck(batch_id=result.batch_id, accepted=result.accepted,
                     duplicate=result.duplicate)


async def queue_from_cache(state, principal: Principal, body: bytes,
                           content_type: str) -> IngestAck | None:
    """`store_batch` on the event loop, for a small body whose deployment this process has
    cached: checked from the caches and appended to the stream with the asyncio Redis client.
    None when `store_batch` must answer on a worker thread (anything that would read the
    store, Redis unreachable). A small body (the edge's fast path sends at most
    SMALL_BODY_BYTES) holds the loop well under a millisecond."""
    try:
        batch = checked_from_cache(state, principal, body, content_type)
    except DomainError as error:
        refusal = refused(error)
    else:
        refusal = None
    if refusal is not None:
        raise refusal from None  # outside the `except`: nothing holds the decoded batch
    if batch is None:
        return None
    try:
        added = await stream.append_async(state.redis_async, batch, _as_sent(body, content_type),
                                          witness=witness_of_post(principal, batch))
    except (redis.RedisError, OSError):
        return None  # `store_batch` answers it: the queue's 503
    return queued_ack(batch, added)


def _as_sent(body: bytes, content_type: str) -> bytes | None:
    """The body the stream keeps as it came (msgpack), or None (it keeps the batch encoded)."""
    return body if "msgpack" in content_type else None


@router.post("/v1/telemetry", status_code=status.HTTP_202_ACCEPTED, response_model=IngestAck,
             openapi_extra={"requestBody": {"content": {
                 RECORDS_JSON: {"schema": TelemetryBatch.model_json_schema()},
                 RECORDS_MSGPACK: {"schema": {"type": "string", "format": "binary"}},
                 AGGREGATE_JSON: {"schema": AggregateBatch.model_json_schema()},
                 AGGREGATE_MSGPACK: {"schema": {"type": "string", "format": "binary"}},
                 INTERVAL_JSON: {"schema": IntervalBatch.model_json_schema()},
                 INTERVAL_MSGPACK: {"schema": {"type": "string", "format": "binary"}}},
                 "required": True}},
             responses={**RUNTIME_ERRORS,
                        404: error_answer("the batch names a deployment that does not exist"),
                        409: error_answer("the batch's runtime id is new and the runtime caps "
                                          "are full (per deployment, per token)"),
                        413: error_answer("the body is over the limit (bytes, or values "
                                          "decoded): split it (ids <id>a and <id>b)"),
                        415: error_answer("a content type this control plane does not take"),
                        429: error_answer("rate limited, or this API process is decoding "
                                          "as many large batches as it may: wait "
                                          "Retry-After seconds"),
                        422: error_answer("the batch is invalid: `detail` names the first bad "
                                          "record or cell, `index` its position; drop it")})
async def ingest_telemetry(request: Request, principal: RuntimePrincipal) -> IngestAck:
    """Store (or queue) one batch of token records, one aggregate batch or one interval batch
    (by content type: docs/protocol.md); a replayed batch id is acknowledged with
    duplicate=true."""
    state = request.app.state
    # The dependencies checked the token and its rate from the headers; only now the body.
    with state.telemetry_decodes.held(request.headers.get("content-length")) as charge:
        body = await request.body()
        content_type = request.headers.get("content-type", "application/json")
        return await to_thread.run_sync(store_batch, state, principal, body, content_type,
                                        charge)


@dataclass(frozen=True)
class Window:
    """The query every telemetry read takes: a time window, optionally one version/runtime."""

    since: Annotated[datetime | None, Query(description="default: one hour ago")] = None
    until: datetime | None = None
    version: int | None = None
    runtime_id: str | None = None
    segment: Annotated[str | None, Query(
        pattern=NAME_PATTERN, description="one traffic segment ('default' or a registered "
                                          "name); default: every segment summed")] = None

    def filters(self) -> dict:
        since = self.since or datetime.now(UTC) - timedelta(hours=1)
        return {"since": since, "until": self.until, "version": self.version,
                "runtime_id": self.runtime_id, "segment": self.segment}


WindowDep = Annotated[Window, Depends()]


def _own_deployment(session, principal: Principal, name: str, segment: str | None = None):
    deployment = get_deployment(session=session, name=name)
    principal.require_deployment(deployment.id)
    reads.check_segment(session=session, deployment=deployment, segment=segment)
    return deployment


@router.get("/v1/deployments/{name}/telemetry/exit-rates", response_model=list[ExitRatePoint])
def exit_rates(name: str, session: SessionDep, principal: RuntimePrincipal,
               window: WindowDep) -> list[ExitRatePoint]:
    """Per-minute exit counts per exit layer from the rollups, for a window, version and segment."""
    deployment = _own_deployment(session, principal, name, window.segment)
    rows = service.exit_rates(session=session, deployment=deployment, **window.filters())
    return [ExitRatePoint(**row) for row in rows]


@router.get("/v1/deployments/{name}/telemetry/disagreement",
            response_model=list[DisagreementPoint])
def disagreement(name: str, session: SessionDep, principal: RuntimePrincipal,
                 window: WindowDep) -> list[DisagreementPoint]:
    """Per-minute shadow agreement per exit layer (matches and totals) from the rollups."""
    deployment = _own_deployment(session, principal, name, window.segment)
    rows = service.disagreement(session=session, deployment=deployment, **window.filters())
    return [DisagreementPoint(**row) for row in rows]


@router.get("/v1/deployments/{name}/telemetry/signal-histogram",
            response_model=dict[int, list[int]])
def signal_histogram(name: str, session: SessionDep, principal: RuntimePrincipal,
                     window: WindowDep) -> dict[int, list[int]]:
    """Per exit layer (and full depth): counts of the signal at exit in 20 bins over [0, 1], over a
    window."""
    deployment = _own_deployment(session, principal, name, window.segment)
    return service.signal_histogram(session=session, deployment=deployment, **window.filters())


@router.get("/v1/deployments/{name}/telemetry/count", response_model=TelemetryCounts)
def telemetry_count(name: str, session: SessionDep,
                    principal: RuntimePrincipal) -> TelemetryCounts:
    """What the store holds for the deployment: records, batches, shadow samples and the tokens
    counted in the rollups."""
    deployment = _own_deployment(session, principal, name)
    return TelemetryCounts(**service.counts(session=session, deployment=deployment))


@router.get("/v1/deployments/{name}/segments", response_model=SegmentReport)
def segments(name: str, session: SessionDep, principal: RuntimePrincipal,
             window_s: Annotated[int, Query(ge=60, le=31 * 86400, description=(
                 "the window ending now, in seconds"))] = 3600,
             version: int | None = None, runtime_id: str | None = None) -> SegmentReport:
    """Per traffic segment (`default` and each registered one) over the last `window_s`
    seconds: tokens, exit rate, shadow tokens and disagreement, from the rollups."""
    deployment = _own_deployment(session, principal, name)
    since = datetime.now(UTC) - timedelta(seconds=window_s)
    figures = reads.segment_summary(session=session, deployment=deployment, since=since,
                                    version=version, runtime_id=runtime_id)
    return SegmentReport(
        deployment=deployment.name, since=since, delta=deployment.delta,
        segments=[item.as_dict() for item in figures],
        records_sampled=reads.records_sampled(session=session, deployment=deployment),
        raw_sample_rate=service.raw_sample_rate(session=session, deployment=deployment))
