"""Production ingestion through Redis Streams: the API appends checked batches to one stream
per deployment; ingest workers read them with a consumer group, write them to the store in
bulk, acknowledge after the commit, and reclaim entries a crashed worker left pending.

No loss: an entry is acknowledged only after its rows are committed. No duplicates: the API
appends a batch id once per deployment (a Lua script sets the deployment's id key and appends
atomically) and the store refuses a batch id the deployment already has, so a reclaimed entry
that was committed is a no-op. Another deployment's batch with the same id is its own.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import redis
import redis.asyncio
from sqlalchemy.orm import Session, sessionmaker

from controlplane import metrics
from controlplane.db import refused_by_store, store_away
from controlplane.deployments.cache import DeploymentCache
from controlplane.runtimes.witnesses import witness_of
from controlplane.telemetry.columns import BatchColumns, parse_batch
from controlplane.telemetry.service import ingest
from exitplane.kit import tracing
from exitplane.wire import AggregateBatch, IntervalBatch

log = logging.getLogger("exitplane.ingest")

STREAM_PREFIX = "exitplane:telemetry:"
STREAMS_KEY = "exitplane:telemetry-streams"
SEEN_PREFIX = "exitplane:batch-seen:"
GROUP = "ingest"
DEAD_LETTER = "exitplane:telemetry-dead"
SEEN_TTL_S = 7 * 24 * 3600

# KEYS: seen key, stream, streams set; ARGV: payload, ttl, stream name, entry field, witness.
_APPEND_ONCE = """
if redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[2]) then
  redis.call('SADD', KEYS[3], ARGV[3])
  return redis.call('XADD', KEYS[2], '*', ARGV[4], ARGV[1], 'witness', ARGV[5])
end
return false
"""
# The entry field says what the body is: an interval batch has a field of its own, so that an
# older worker dead-letters it instead of reading it as an aggregate batch without its records.
_FIELDS = {BatchColumns: "batch", AggregateBatch: "aggregate", IntervalBatch: "interval"}


def _field(batch: BatchColumns | AggregateBatch) -> str:
    return _FIELDS[type(batch)]

# client -> the script registered with it (called by its SHA: EVALSHA, not the text each time)
_scripts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def stream_key(deployment: str) -> str:
    return STREAM_PREFIX + deployment


def seen_key(batch: BatchColumns | AggregateBatch) -> str:
    """The key that marks `batch`'s id as appended for its deployment (a deployment name holds
    no ':', so no two (deployment, id) pairs share a key)."""
    return f"{SEEN_PREFIX}{batch.deployment}:{batch.batch_id}"


def append(client: redis.Redis, batch: BatchColumns | AggregateBatch,
           body: bytes | None = None, *, witness: str | None = None) -> bool:
    """Append `batch` (records, or an aggregate batch) to its deployment's stream unless its
    id was appended before. `body`: the msgpack `batch` was decoded and checked from, appended
    as it came (the worker parses it the same way, so re-encoding would only cost the API).
    `witness`: who vouches for it (`runtimes.witnesses`; None: its runtime id)."""
    if body is None:
        body = _wire_body(batch)
    key = stream_key(batch.deployment)
    added = client.eval(_APPEND_ONCE, 3, seen_key(batch), key, STREAMS_KEY,
                        body, SEEN_TTL_S, key, _field(batch), _witness(batch, witness))
    return bool(added)


def _witness(batch: BatchColumns | AggregateBatch, witness: str | None) -> str:
    return witness or witness_of(token_id=None, runtime_id=batch.runtime_id)


def entry_witness(fields: dict, batch: BatchColumns | AggregateBatch) -> str:
    """The witness a stream entry was appended with (its runtime id for an entry without)."""
    value = fields.get(b"witness", fields.get("witness"))
    if isinstance(value, bytes):
        value = value.decode()
    return value or witness_of(token_id=None, runtime_id=batch.runtime_id)


async def append_async(client: redis.asyncio.Redis, batch: BatchColumns | AggregateBatch,
                       body: bytes | None = None, *, witness: str | None = None) -> bool:
    """`append` on the event loop, through an asyncio client. Raises what the client raises
    when Redis cannot be reached."""
    if body is None:
        body = _wire_body(batch)
    script = _scripts.get(client)
    if script is None:
        script = _scripts[client] = client.register_script(_APPEND_ONCE)
    key = stream_key(batch.deployment)
    added = await script(keys=[seen_key(batch), key, STREAMS_KEY],
                         args=[body, SEEN_TTL_S, key, _field(batch), _witness(batch, witness)])
    return bool(added)


def _wire_body(batch: BatchColumns | AggregateBatch) -> bytes:
    wire = batch.model_dump(mode="json") if isinstance(batch, AggregateBatch) \
        else batch.to_wire()
    return msgpack.packb(wire, use_bin_type=True)


def _parse_entry(fields: dict) -> BatchColumns | AggregateBatch:
    """A stream entry's batch: field `batch` holds records, `aggregate` an aggregate batch,
    `interval` an interval batch."""
    for name, model in (("aggregate", AggregateBatch), ("interval", IntervalBatch)):
        payload = fields.get(name.encode(), fields.get(name))
        if payload is not None:
            return model.model_validate(msgpack.unpackb(payload, raw=False))
    return parse_batch(msgpack.unpackb(fields.get(b"batch", fields.get("batch")), raw=False))


@dataclass
class ConsumeStats:
    entries: int = 0
    batches: int = 0
    duplicates: int = 0
    dead: int = 0
    reclaimed: int = 0


class StreamIngestor:
    """One ingest worker: consumer `name` of group `ingest` on every deployment's stream."""

    def __init__(self, client: redis.Redis, session_factory: sessionmaker[Session], *,
                 name: str, count: int = 100, block_ms: int = 1000,
                 claim_idle_ms: int = 30_000) -> None:
        self.client = client
        self.session_factory = session_factory
        self.name = name
        self.count = count
        self.block_ms = block_ms
        self.claim_idle_ms = claim_idle_ms
        self.stats = ConsumeStats()
        self._groups: set[str] = set()
        # A deployment's id, layers and name never change and it is never deleted: read once
        # per worker, not once per stream read.
        self._targets = DeploymentCache(session_factory)

    def streams(self) -> list[str]:
        keys = sorted(map(_text, self.client.smembers(STREAMS_KEY)))
        for key in keys:
            if key not in self._groups:
                try:
                    self.client.xgroup_create(key, GROUP, id="0", mkstream=True)
                except redis.ResponseError as error:
                    if "BUSYGROUP" not in str(error):
                        raise
                self._groups.add(key)
        return keys

    def run_once(self, stop: threading.Event | None = None) -> int:
        """Reclaim stale entries, then read new ones; returns entries processed. With no
        stream yet (no telemetry so far), waits `block_ms` (or until `stop`) as a blocking
        read would, instead of returning at once: a worker must not spin on Redis."""
        keys = self.streams()
        if not keys:
            (stop or threading.Event()).wait(self.block_ms / 1000)
            return 0
        processed = 0
        for key in keys:
            claimed = self.client.xautoclaim(key, GROUP, self.name, self.claim_idle_ms,
                                             start_id="0-0", count=self.count)
            entries = claimed[1]
            if entries:
                self.stats.reclaimed += len(entries)
                processed += self._process(key, entries)
        response = self.client.xreadgroup(GROUP, self.name, dict.fromkeys(keys, ">"),
                                          count=self.count, block=self.block_ms)
        for key, entries in response or []:
            processed += self._process(_text(key), entries)
        return processed

    def run_forever(self, stop: threading.Event,
                    each_cycle: Callable[[], None] | None = None) -> None:
        """Ingest until `stop`; `each_cycle` runs as every cycle begins (the heartbeat)."""
        while not stop.is_set():
            if each_cycle is not None:
                each_cycle()
            try:
                self.run_once(stop)
                self.report_lag()
            except (redis.ConnectionError, redis.TimeoutError) as error:
                log.warning("redis unavailable (%s); retrying", error)
                self._groups.clear()
                stop.wait(1.0)
            except Exception:
                log.exception("ingest cycle failed; entries stay pending and will be reclaimed")
                stop.wait(1.0)

    def report_lag(self) -> None:
        for key in self.streams():
            for group in self.client.xinfo_groups(key):
                if _text(group.get("name")) == GROUP:
                    lag = (group.get("lag") or 0) + (group.get("pending") or 0)
                    metrics.stream_lag.labels(key.removeprefix(STREAM_PREFIX)).set(lag)
        metrics.dead_letter_entries.set(self.client.xlen(DEAD_LETTER))

    @tracing.traced("telemetry.ingest")  # one span per read of one stream: its batches
    def _process(self, key: str, entries: list) -> int:
        deployment_name = key.removeprefix(STREAM_PREFIX)
        parsed, ids, dead = [], [], []
        for entry_id, fields in entries:
            if not fields:  # deleted while pending
                ids.append(entry_id)
                continue
            try:
                parsed.append((entry_id, fields, _parse_entry(fields)))
            except Exception as error:  # never block the stream on one bad entry
                log.error("stream %s entry %s unreadable (%s); moved to %s", key, entry_id,
                          error, DEAD_LETTER)
                dead.append((entry_id, fields, f"unreadable: {error}"))
        if parsed:
            try:
                self._store(deployment_name, [batch for _, _, batch in parsed],
                            [entry_witness(fields, batch) for _, fields, batch in parsed])
                ids += [entry_id for entry_id, _, _ in parsed]
            except Exception as error:
                if _transient(error):
                    raise  # the entries stay pending and are read again
                stored, refused = self._one_by_one(key, deployment_name, parsed, error)
                ids += stored
                dead += refused
        # One MULTI: a dead letter is written together with its acknowledgement, so a worker
        # that dies between the two can neither leave it pending (to be dead-lettered again
        # when reclaimed) nor acknowledge it unwritten.
        ids += [entry_id for entry_id, _, _ in dead]
        if ids:
            with self.client.pipeline(transaction=True) as pipe:
                for _, fields, why in dead:
                    pipe.xadd(DEAD_LETTER, {**fields, b"stream": key.encode(),
                                            b"error": why[:1000].encode()})
                pipe.xack(key, GROUP, *ids)
                pipe.execute()
        tracing.annotate(deployment=deployment_name, batches=len(parsed), dead_lettered=len(dead))
        if dead:
            metrics.dead_lettered_batches.labels(deployment_name).inc(len(dead))
            self.stats.dead += len(dead)
        self.stats.entries += len(ids)
        return len(ids)

    def _store(self, deployment_name: str, batches: list, witnesses: list[str]) -> None:
        """Store `batches` of one deployment in one transaction and count them."""
        deployment = self._targets.get(deployment_name, ())
        with self.session_factory() as session:
            results = ingest(session=session, deployment=deployment, batches=batches,
                             witnesses=witnesses)
            session.commit()
        for result in results:
            if result.duplicate:
                self.stats.duplicates += 1
                metrics.duplicate_batches.labels(deployment_name).inc()
            else:
                metrics.ingested_batches.labels(deployment_name).inc()
                metrics.dead_lettered_batches.labels(deployment_name)  # a series at 0 first
                metrics.ingested_records.labels(deployment_name).inc(result.records)
                # at 0 from the first batch on: a rate over it sees the first overflow
                metrics.segment_overflow_tokens.labels(deployment_name).inc(result.overflow)
                metrics.count_costs(deployment_name, timed=result.timed_tokens,
                                    wall_us=result.wall_us, layers=result.layers_saved)
        self.stats.batches += len(batches)

    def _one_by_one(self, key: str, deployment_name: str, parsed: list,
                    error: Exception) -> tuple[list, list]:
        """After a read's transaction failed on something other than the store being away:
        store each entry alone, so that one batch the store refuses (a sum past its BIGINT, a
        value it cannot hold) cannot hold back the batches read with it, nor every later read
        (the failed entries would be reclaimed, and fail, first each time). Returns (entry ids
        stored, [(entry id, fields, why)] to dead-letter). An entry goes to the dead letters
        when the store refuses its data, or when it fails alone while others stored; when
        every entry fails (a fault of the worker, not of a batch) they stay pending, to be
        reclaimed after `claim_idle_ms`; the other streams and later entries go on."""
        stored, failed = [], []
        if len(parsed) == 1:  # it failed alone already
            failed.append((*parsed[0][:2], error))
            parsed = []
        for entry_id, fields, batch in parsed:
            try:
                self._store(deployment_name, [batch], [entry_witness(fields, batch)])
                stored.append(entry_id)
            except Exception as failure:
                if _transient(failure):
                    raise  # those stored are acknowledged when read again, as replays
                failed.append((entry_id, fields, failure))
        refused = [(entry_id, fields, f"refused by the store: {type(why).__name__}: {why}")
                   for entry_id, fields, why in failed if stored or refused_by_store(why)]
        for entry_id, _, why in refused:
            log.error("stream %s entry %s cannot be stored (%s); moved to %s", key, entry_id,
                      why, DEAD_LETTER)
        if len(refused) < len(failed):
            log.error("stream %s: %d entries failed alone and stay pending (%s)", key,
                      len(failed) - len(refused), failed[0][2])
        return stored, refused


def _transient(error: Exception) -> bool:
    """Whether `error` says the store or Redis is away or busy: retry the same entries later."""
    return isinstance(error, redis.RedisError) or store_away(error)


@dataclass(frozen=True)
class DeadLetter:
    """An entry of the dead-letter stream: where it came from, why, and its batch id."""

    entry_id: str
    deployment: str
    kind: str  # batch, aggregate or interval (the entry field), or '?' when unreadable
    batch_id: str
    error: str


def dead_letters(client: redis.Redis, count: int = 10_000) -> list[DeadLetter]:
    """The oldest `count` entries of the dead-letter stream."""
    found = []
    for entry_id, fields in client.xrange(DEAD_LETTER, count=count):
        fields = {_text(name): value for name, value in fields.items()}
        kind = next((name for name in _FIELDS.values() if name in fields), "?")
        try:
            batch_id = str(msgpack.unpackb(fields[kind], raw=False).get("batch_id", "?"))
        except Exception:  # an unreadable entry is listed as such
            batch_id = "?"
        found.append(DeadLetter(
            entry_id=_text(entry_id), kind=kind, batch_id=batch_id,
            deployment=_text(fields.get("stream", b"")).removeprefix(STREAM_PREFIX),
            error=_text(fields.get("error", b"")) or "(no reason recorded)"))
    return found


def replay_dead_letters(client: redis.Redis, entry_ids: list[str] | None = None) -> int:
    """Move dead letters (all, or `entry_ids`) back to the streams they came from, for the
    ingest workers to read again (after a fix: a batch that fails again comes back here). Each
    move is one transaction (appended and removed together); a batch the store already holds
    is skipped by its id. Returns how many were moved."""
    wanted = None if entry_ids is None else set(entry_ids)
    moved = 0
    for entry_id, fields in client.xrange(DEAD_LETTER):
        if wanted is not None and _text(entry_id) not in wanted:
            continue
        fields = dict(fields)
        key = fields.pop(b"stream", None)
        fields.pop(b"error", None)
        if key is None or not _text(key).startswith(STREAM_PREFIX):
            continue  # nowhere to return it to
        with client.pipeline(transaction=True) as pipe:
            pipe.sadd(STREAMS_KEY, key)
            pipe.xadd(key, fields)
            pipe.xdel(DEAD_LETTER, entry_id)
            pipe.execute()
        moved += 1
    return moved


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value
