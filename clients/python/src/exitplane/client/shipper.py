"""Ship the engine's token records (and, when aggregating at the edge, exact per-minute counts)
to the control plane without ever blocking the decode loop: the queue and the sender thread.
The batches' encoding is `exitplane.client.codec`, the disk spool `exitplane.client.spool`, the
backoff and Retry-After rules (shared with the threshold client) `exitplane.client.retry`.

`TelemetryShipper.submit` is the engine's `on_record` callback: it appends to a bounded
in-memory queue and returns at once (a full queue drops the record and counts it). A sender
thread cuts batches by size or age, encodes them (msgpack of `TelemetryBatch`, JSON optional)
and POSTs them to `/v1/telemetry`. A batch that cannot be delivered after a few retries with
jittered exponential backoff goes to the disk spool (`Spool`); while anything is spooled, new
batches queue behind it, and the spool replays in order, with the same batch ids, once the
control plane answers again. The spool is capped; past the cap, batches are dropped and their
records counted. What is on disk at start-up is replayed too.

Edge aggregation (`raw_sample_rate` < 1, or `aggregate=True`): every submitted token is counted
by an `Aggregator`; only shadow tokens and a random `raw_sample_rate` share of the others are
queued as records (batches flagged `aggregated`, so they add no token counts to the rollups).
Every `aggregate_interval_s` the counts are cut and shipped together with the records queued
so far as one **interval batch** (`IntervalBatch`: the counts as cells, the records column by
column), so a runtime sends one request per interval; it takes the same road as record
batches: own batch id and seq, retries, spool, in-order replay, 413 split (its cells and its
records in halves). A queue that reaches `batch_records` before the cut leaves at once as an
interval batch of records alone. A control plane that does not accept interval batches answers 415:
the shipper then sends that batch as the aggregate batch and the `aggregated` record batch it
stands for, and keeps to that pair from then on (`bundle=False` asks for the pair from the
start; the records then leave every `batch_interval_s`, by default the aggregates' interval).
With the default 1.0 nothing is aggregated: every token is a record.

Server answers: 202 delivered (a replay is 202 with duplicate=true); 422 (or another 4xx) the
batch is bad, logged and counted as rejected, never retried; 413 split in halves (ids derived
from the parent's, so a replay re-splits to the same ids); 401/403 a configuration error,
logged loudly, batches stay spooled; 429/503 honour Retry-After; 5xx and network errors retry.
A spooled batch answered with a server error (500; not 502/503/504, which are outages) on
`set_aside_after` replays in a row is set aside (`Spool.set_aside`) so the batches behind it go
on; set-aside batches are retried every `aside_retry_s` once the spool has caught up.
"""

from __future__ import annotations

import collections
import logging
import os
import random
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError

from exitplane.client import retry
from exitplane.client.aggregate import Aggregator
from exitplane.client.codec import (
    ENCODINGS,
    EncodedBatch,
    encode_aggregate,
    encode_interval,
    encode_records,
)
from exitplane.client.http import http_client
from exitplane.client.spool import SeqCounter, Spool
from exitplane.wire import (
    MAX_AGGREGATE_CELLS,
    RECORDS_JSON,
    RECORDS_MSGPACK,
    Lineage,
    RecordColumns,
    TokenRecord,
    check_runtime_id,
)

log = logging.getLogger("exitplane.client.shipper")

MSGPACK = RECORDS_MSGPACK
JSON = RECORDS_JSON


class TelemetryShipper:
    """Bounded queue + sender thread + disk spool; see the module docstring."""

    def __init__(self, *, base_url: str, token: str, deployment: str, runtime_id: str,
                 num_layers: int, spool_dir: str | os.PathLike, queue_size: int = 100_000,
                 batch_records: int = 1000, batch_interval_s: float | None = None,
                 spool_max_bytes: int = 256 << 20, segment_bytes: int = 8 << 20,
                 max_attempts: int = 4, backoff_initial_s: float = 0.2,
                 backoff_max_s: float = 30.0, request_timeout_s: float = 10.0,
                 encoding: str = "msgpack", fsync: bool = True, raw_sample_rate: float = 1.0,
                 aggregate: bool | None = None, exit_layers: Iterable[int] | None = None,
                 aggregate_interval_s: float = 5.0, bundle: bool = True,
                 set_aside_after: int = 5, aside_retry_s: float = 600.0,
                 head_digest: str | None = None, model_revision: str | None = None,
                 **http: Any):
        """`head_digest`, `model_revision`: what this runtime serves, carried by every batch
        (None: unknown; docs/protocol.md, "Lineage"). `http`: how requests reach the control
        plane (`verify`, `cert`, `proxy`, `headers`, `transport`: `exitplane.client.http`)."""
        check_runtime_id(runtime_id)
        # Checked here as the wire checks them: a bad value would get every batch refused.
        self.lineage = Lineage(head_digest=head_digest or None,
                               model_revision=model_revision or None)
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding must be 'msgpack' or 'json', not {encoding!r}")
        if not 0.0 <= raw_sample_rate <= 1.0:
            raise ValueError(f"raw_sample_rate must be in [0, 1], not {raw_sample_rate!r}")
        if aggregate is None:
            aggregate = raw_sample_rate < 1.0
        if raw_sample_rate < 1.0 and not aggregate:
            raise ValueError("sampling records (raw_sample_rate < 1) needs aggregate=True, or "
                             "the control plane would count only the sampled tokens")
        if aggregate and exit_layers is None:
            raise ValueError("aggregating needs the deployment's exit_layers")
        self.raw_sample_rate = raw_sample_rate
        self.aggregate_interval_s = aggregate_interval_s
        # Records ride in the interval batches (until a control plane answers 415 to them).
        self.bundle = bool(aggregate and bundle)
        self.aggregator = Aggregator(exit_layers=exit_layers, num_layers=num_layers) \
            if aggregate else None
        self._aggregate_due = time.monotonic() + aggregate_interval_s
        self._sample = random.Random().random
        self.deployment = deployment
        self.runtime_id = runtime_id
        self.num_layers = num_layers
        self.queue_size = queue_size
        self.batch_records = batch_records
        # Aggregating, the records left (shadow and sampled) ride at the aggregates' pace by
        # default: one request per runtime per interval for both, not a record batch a
        # second (at fleet scale the control plane's cost is per request, not per token).
        self.batch_interval_s = batch_interval_s if batch_interval_s is not None else (
            aggregate_interval_s if aggregate else 1.0)
        self.max_attempts = max(1, max_attempts)
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.content_type, self.aggregate_content_type, self.interval_content_type = \
            ENCODINGS[encoding]
        self.spool = Spool(spool_dir, max_bytes=spool_max_bytes, segment_bytes=segment_bytes,
                           fsync=fsync)
        self._seq = SeqCounter(Path(spool_dir) / "seq", self.spool.max_seq + 1)
        self._http = http_client(base_url=base_url, token=token, timeout=request_timeout_s,
                                 **http)
        self._queue: collections.deque[TokenRecord] = collections.deque()
        self._queue_since: float | None = None  # when the oldest queued record was seen
        self._in_flight = 0  # records cut from the queue and not yet sent or spooled
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._flushes: collections.deque[threading.Event] = collections.deque()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.online = True
        self._probe_at = 0.0
        self._probe_failures = 0
        self._head_parts: list[EncodedBatch] | None = None  # a spooled batch split by a 413
        # A server error (500) on the spool's head, replay after replay, while the control
        # plane answers: after `set_aside_after` of them the head is set aside (kept on disk,
        # retried every `aside_retry_s` once caught up) so one batch that trips a server bug
        # cannot hold back every later one.
        self.set_aside_after = max(1, set_aside_after)
        self.aside_retry_s = aside_retry_s
        self._aside_due = time.monotonic() + aside_retry_s
        self._faulted = False  # the last answer was a server error
        self._head_faults = 0
        self._auth_logged_at = -1e9
        self.dropped_queue_records = 0  # written only by submit (the decode thread)
        self.counters = {"sent_batches": 0, "sent_records": 0, "duplicate_batches": 0,
                         "spooled_batches": 0, "replayed_batches": 0, "dropped_spool_records": 0,
                         "rejected_batches": 0, "rejected_records": 0, "retries": 0,
                         "send_errors": 0, "auth_errors": 0, "splits": 0,
                         "sent_aggregate_batches": 0, "sent_aggregate_tokens": 0,
                         "dropped_aggregate_tokens": 0, "rejected_aggregate_tokens": 0,
                         # delivered before, its answer lost (a crash, a timeout): acknowledged
                         # now as a replay, so sent_* + duplicate_* is what the server holds
                         "duplicate_records": 0, "duplicate_aggregate_tokens": 0,
                         "set_aside_batches": 0, "recovered_aside_batches": 0}
        self.unaggregated_records = 0  # submitted at a layer the deployment lacks (refused)
        if self.spool.pending_batches:
            log.info("found %d spooled telemetry batches in %s; replaying them first",
                     self.spool.pending_batches, self.spool.directory)

    # -- public ----------------------------------------------------------------------------
    def submit(self, record: TokenRecord) -> bool:
        """Queue one record (the engine's `on_record`); never blocks, drops when full. When
        aggregating, count it, and queue it only if shadow or sampled."""
        queue = self._queue
        aggregator = self.aggregator
        if aggregator is not None and not self._closed:
            if not aggregator.add(record):
                self.unaggregated_records += 1
                return False
            if record.shadow is None and self._sample() >= self.raw_sample_rate:
                return True
        if self._closed or len(queue) >= self.queue_size:
            self.dropped_queue_records += 1
            return False
        queue.append(record)
        if self._queue_since is None:
            self._queue_since = time.monotonic()
        if len(queue) == self.batch_records:  # once per full batch: Event.set is not free
            self._wake.set()
        return True

    def set_token(self, token: str) -> None:
        """Use `token` from the next request on (a rotated runtime token)."""
        self._http.headers["Authorization"] = f"Bearer {token}"

    @property
    def spooled_batches(self) -> int:
        """Batches on disk waiting for the control plane, set-aside ones included (what a
        heartbeat reports)."""
        return self.spool.pending_batches + self.spool.aside_count

    @property
    def dropped_records(self) -> int:
        """Records lost (queue full or spool cap reached), and tokens an aggregate batch lost
        from the counts (spool cap reached)."""
        return (self.dropped_queue_records + self.counters["dropped_spool_records"]
                + self.counters["dropped_aggregate_tokens"])

    @property
    def metrics(self) -> dict[str, int]:
        """Counters and gauges for scraping or a heartbeat."""
        return {**self.counters, "dropped_queue_records": self.dropped_queue_records,
                "dropped_records": self.dropped_records, "queue_depth": len(self._queue),
                "spool_pending_batches": self.spool.pending_batches,
                "spool_aside_batches": self.spool.aside_count,
                "spool_bytes": self.spool.total_bytes, "online": int(self.online)}

    def start(self) -> TelemetryShipper:
        """Start the sender thread (it replays what an earlier process spooled first)."""
        if self._thread is not None:
            raise RuntimeError("the shipper is already started")
        self._thread = threading.Thread(target=self._run, name="exitplane-shipper", daemon=True)
        self._thread.start()
        return self

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every record submitted so far is delivered, rejected or spooled."""
        if self._thread is None or not self._thread.is_alive():
            return not self._queue
        done = threading.Event()
        self._flushes.append(done)
        self._wake.set()
        return done.wait(timeout)

    def close(self, timeout: float | None = 30.0) -> bool:
        """Ship or spool what is queued, then stop; True when the thread finished in time."""
        self._closed = True
        self._closing.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
        else:
            self._drain(closing=True)
            self._ship_aggregates(closing=True)
        self.spool.close()
        self._http.close()
        return True

    def wait_replayed(self, timeout: float) -> bool:
        """Block until nothing is queued, counted, in flight or spooled (tests, graceful
        hand-over)."""
        deadline = time.monotonic() + timeout
        while (self.spool.pending_batches or self._queue or self._in_flight
               or (self.aggregator is not None and self.aggregator.pending_tokens)):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    # -- the sender thread -----------------------------------------------------------------
    def _run(self) -> None:
        while not self._closing.is_set():
            flushes = []
            while self._flushes:
                flushes.append(self._flushes.popleft())
            try:
                self._drain(force=bool(flushes))
                self._ship_aggregates(force=bool(flushes))
                self._replay()
                self._retry_aside()
            except Exception:  # a disk or encoding fault must not stop shipping for good
                log.exception("telemetry shipper error; retrying")
                self._mark_offline(None)
                self._flushes.extendleft(reversed(flushes))  # not done: they wait on
                flushes = []
            for done in flushes:
                done.set()
            self._wake.wait(self._sleep_s())
            self._wake.clear()
        try:
            self._drain(closing=True)
            self._ship_aggregates(closing=True)
        finally:
            while self._flushes:
                self._flushes.popleft().set()

    def _sleep_s(self) -> float:
        now = time.monotonic()
        wait = self.batch_interval_s
        if self._queue_since is not None and not self.bundle:  # bundled: they wait for the cut
            wait = self._queue_since + self.batch_interval_s - now
        if self.spool.pending_batches:
            wait = min(wait, self._probe_at - now)
        if self.aggregator is not None:
            wait = min(wait, self._aggregate_due - now)
        return max(0.005, wait)

    def _drain(self, *, force: bool = False, closing: bool = False) -> None:
        """Cut and dispatch every batch that is due (all of them when forced or closing)."""
        while self._queue:
            now = time.monotonic()
            if self._queue_since is None:
                self._queue_since = now
            # Bundled, only a full batch leaves here: the rest rides with the next cut of the
            # counts (`_ship_aggregates`, which a flush or close forces too).
            due = len(self._queue) >= self.batch_records or (not self.bundle and (
                force or closing or now - self._queue_since >= self.batch_interval_s))
            if not due:
                return
            batch = self._cut()
            self._queue_since = now if self._queue else None
            if batch is not None:
                self._in_flight = batch.records + batch.rows
                try:
                    self._dispatch(batch, closing=closing)
                finally:
                    self._in_flight = 0

    def _cut(self) -> EncodedBatch | None:
        records = self._take_records()
        seq = self._seq.take()
        try:
            if self.bundle:
                return self._interval(seq, [], records)
            return encode_records(deployment=self.deployment, runtime_id=self.runtime_id,
                                  seq=seq, num_layers=self.num_layers, records=records,
                                  aggregated=self.aggregator is not None,
                                  content_type=self.content_type, lineage=self.lineage)
        except ValidationError as exc:
            self._refuse_records(records, exc)
            return None

    def _ship_aggregates(self, *, force: bool = False, closing: bool = False) -> None:
        """Cut the counts into aggregate batches and dispatch them, when due."""
        aggregator = self.aggregator
        if aggregator is None:
            return
        now = time.monotonic()
        if not (force or closing or now >= self._aggregate_due):
            return
        self._aggregate_due = now + self.aggregate_interval_s
        cells = aggregator.cut()
        records = []
        if self.bundle:  # the queued records ride with the counts
            records = self._take_records()
            self._queue_since = now if self._queue else None
        for start in range(0, max(len(cells), 1), MAX_AGGREGATE_CELLS):
            part = cells[start:start + MAX_AGGREGATE_CELLS]
            if not (part or records):
                return
            seq = self._seq.take()
            try:
                encoded = self._interval(seq, part, records) if self.bundle else \
                    encode_aggregate(deployment=self.deployment, runtime_id=self.runtime_id,
                                     seq=seq, num_layers=self.num_layers,
                                     raw_sample_rate=self.raw_sample_rate, cells=part,
                                     content_type=self.aggregate_content_type,
                                     lineage=self.lineage)
            except ValidationError as exc:  # a bad record: the counts must still leave
                self._refuse_records(records, exc)
                records = []
                encoded = self._interval(seq, part, records)
            carried, records = records, []  # they ride with the first part only
            self._in_flight = encoded.records + encoded.rows
            try:
                self._dispatch(encoded, closing=closing)
            except BaseException:
                aggregator.restore(cells[start:])  # counted again at the next cut
                self._queue.extendleft(reversed(carried))  # and sent with it
                raise
            finally:
                self._in_flight = 0

    def _take_records(self) -> list[TokenRecord]:
        """Up to one batch of queued records, oldest first."""
        take = min(len(self._queue), self.batch_records)
        return [self._queue.popleft() for _ in range(take)]

    def _interval(self, seq: int, cells: list, records: list[TokenRecord]) -> EncodedBatch:
        """An interval batch of `cells` and `records` (ValidationError when a record is
        bad)."""
        return encode_interval(deployment=self.deployment, runtime_id=self.runtime_id, seq=seq,
                               num_layers=self.num_layers, raw_sample_rate=self.raw_sample_rate,
                               cells=cells, records=RecordColumns.of(records) if records
                               else None, content_type=self.interval_content_type,
                               lineage=self.lineage)

    def _refuse_records(self, records: list[TokenRecord], exc: ValidationError) -> None:
        self.counters["rejected_batches"] += 1
        self.counters["rejected_records"] += len(records)
        log.error("dropping a batch of %d records that fails the wire schema: %s",
                  len(records), exc.errors()[0]["msg"])

    def _dispatch(self, batch: EncodedBatch, *, closing: bool) -> None:
        if self.spool.pending_batches or not self.online:
            self._to_spool([batch])  # keep order: nothing overtakes what is spooled
            return
        left = self._deliver(batch, attempts=1 if closing else self.max_attempts)
        if left:
            self._to_spool(left)

    def _to_spool(self, batches: list[EncodedBatch]) -> None:
        for batch in batches:
            if self.spool.append(batch):
                self.counters["spooled_batches"] += 1
            else:
                self.counters["dropped_aggregate_tokens" if batch.is_aggregate
                              else "dropped_spool_records"] += batch.records
                self.counters["dropped_spool_records"] += batch.rows
                log.error("telemetry spool %s is full (%d bytes): dropped batch %s with %d "
                          "records", self.spool.directory, self.spool.max_bytes, batch.batch_id,
                          batch.records)

    def _replay(self) -> None:
        """Send spooled batches in order while the control plane takes them."""
        while self.spool.pending_batches and not self._closing.is_set():
            if not self.online and time.monotonic() < self._probe_at:
                return
            head = self.spool.peek()
            parts = self._head_parts or [head]
            left = []
            for index, part in enumerate(parts):
                left = self._deliver(part, attempts=1)
                if left:
                    left += parts[index + 1:]
                    break
            if left:
                self._head_parts = None if left == [head] else left
                self._head_faults = self._head_faults + 1 if self._faulted else 0
                if self._head_faults < self.set_aside_after:
                    return
                self._set_aside_head()
                continue
            self._head_parts = None
            self._head_faults = 0
            self.spool.pop()
            self.counters["replayed_batches"] += 1
            self._drain()  # records that came in meanwhile queue behind the spool

    def _set_aside_head(self) -> None:
        """The control plane answers, but with a server error for the head batch each time:
        move it aside and go on with the next one at once."""
        head = self.spool.peek()
        path = self.spool.set_aside()
        self._head_parts, self._head_faults = None, 0
        self.counters["set_aside_batches"] += 1
        self._probe_at = 0.0
        log.error("the control plane fails on telemetry batch %s (seq %d, %d records) with a "
                  "server error, %d replays in a row; set aside in %s and retried every %.0f s, "
                  "so the batches after it go on", head.batch_id, head.seq, head.records,
                  self.set_aside_after, path, self.aside_retry_s)

    def _retry_aside(self) -> None:
        """Once the spool has caught up, every `aside_retry_s`: try each set-aside batch once.
        Delivered or refused for good (4xx), it is forgotten; a 413 or 415 sends it back to
        the spool (whose replay splits or unbundles it); anything else keeps it for later."""
        if not self.spool.aside_count or self.spool.pending_batches or not self.online \
                or time.monotonic() < self._aside_due:
            return
        self._aside_due = time.monotonic() + self.aside_retry_s
        for path in self.spool.aside:
            if self._closing.is_set():
                return
            try:
                batch = self.spool.read_aside(path)
            except (OSError, ValueError) as error:
                log.error("set-aside telemetry batch %s is unreadable (%s); leaving it", path,
                          error)
                continue
            outcome, _ = self._post(batch)
            if outcome in ("split", "unbundle"):
                if not self.spool.append(batch):
                    return  # the spool is full: it stays aside
            elif outcome != "done":
                return  # still failing, or the control plane away: next round
            self.spool.drop_aside(path)
            self.counters["recovered_aside_batches"] += 1

    def _deliver(self, batch: EncodedBatch, *, attempts: int) -> list[EncodedBatch]:
        """Send `batch` (splitting it on 413); returns what is still undelivered, in order."""
        for attempt in range(attempts):
            outcome, retry_after = self._post(batch)
            if outcome == "done":
                self._mark_online()
                return []
            if outcome == "unbundle":
                # An older control plane: this batch as the pair it stands for, and the
                # pair from now on (the ids are derived, so a replay unbundles the same).
                if self.bundle:
                    log.warning("the control plane does not take interval batches (415); "
                                "shipping aggregate and record batches instead")
                self.bundle = False
                left: list[EncodedBatch] = []
                for index, part in enumerate(parts := batch.unbundled()):
                    left = self._deliver(part, attempts=attempts)
                    if left:
                        return [*left, *parts[index + 1:]]
                return []
            if outcome == "split":
                halves = batch.split()
                if not halves:
                    self._reject(batch, "a single record exceeds the server's body limit")
                    return []
                self.counters["splits"] += 1
                first = self._deliver(halves[0], attempts=attempts)
                if first:
                    return [*first, halves[1]]
                return self._deliver(halves[1], attempts=attempts)
            if outcome == "auth" or attempt + 1 == attempts:
                self._mark_offline(retry_after)
                return [batch]
            self.counters["retries"] += 1
            delay = retry_after if retry_after is not None else retry.backoff_delay(
                attempt, self.backoff_initial_s, self.backoff_max_s)
            if self._closing.wait(delay):
                return [batch]  # shutting down: the spool takes it
        return [batch]

    def _post(self, batch: EncodedBatch) -> tuple[str, float | None]:
        """One POST: 'done', 'split', 'auth' or 'retry' (with Retry-After seconds if given)."""
        self._faulted = False
        try:
            response = self._http.post("/v1/telemetry", content=batch.body,
                                       headers={"Content-Type": batch.content_type})
        except httpx.HTTPError as exc:
            self.counters["send_errors"] += 1
            log.debug("telemetry batch %s not sent: %s", batch.batch_id, exc)
            return "retry", None
        status = response.status_code
        if status in (200, 201, 202):
            duplicate = _json(response).get("duplicate") is True
            self.counters["sent_aggregate_batches" if batch.is_aggregate else "sent_batches"] += 1
            self.counters["duplicate_batches"] += int(duplicate)
            kind = "aggregate_tokens" if batch.is_aggregate else "records"
            self.counters[f"duplicate_{kind}" if duplicate else f"sent_{kind}"] += batch.records
            self.counters["duplicate_records" if duplicate else "sent_records"] += batch.rows
            return "done", None
        if status == 413:
            return "split", None
        if status == 415 and batch.is_interval:
            return "unbundle", None
        if status in (401, 403, 409):
            self.counters["auth_errors"] += 1
            now = time.monotonic()
            if now - self._auth_logged_at > 60:
                self._auth_logged_at = now
                log.error("the control plane refuses this runtime's telemetry (%d: %s): check "
                          "the runtime token, its deployment and the runtime id (it belongs "
                          "to the token that registered it; the runtime caps may be full); "
                          "batches stay spooled", status, response.text[:300])
            return "auth", None
        if status in (408, 429) or status >= 500:
            self.counters["send_errors"] += 1
            # 502/503/504: away or busy (a proxy's answers too); another 5xx: the control
            # plane failed on this batch
            self._faulted = status >= 500 and status not in (502, 503, 504)
            return "retry", retry.retry_after(response, self.backoff_max_s)
        detail = _json(response).get("detail") or response.text[:300]
        self._reject(batch, f"{status}: {detail}")
        return "done", None

    def _reject(self, batch: EncodedBatch, reason: str) -> None:
        self.counters["rejected_batches"] += 1
        self.counters["rejected_aggregate_tokens" if batch.is_aggregate
                      else "rejected_records"] += batch.records
        self.counters["rejected_records"] += batch.rows
        log.error("control plane rejected telemetry batch %s (seq %d, %d records): %s; not "
                  "retrying it", batch.batch_id, batch.seq, batch.records, reason)

    def _mark_online(self) -> None:
        if not self.online:
            log.info("control plane takes telemetry again; replaying %d spooled batches",
                     self.spool.pending_batches)
        self.online, self._probe_failures = True, 0

    def _mark_offline(self, retry_after: float | None) -> None:
        if self.online:
            log.warning("control plane unreachable for telemetry; spooling to %s",
                        self.spool.directory)
        self.online = False
        delay = retry_after if retry_after is not None else retry.backoff_delay(
            self._probe_failures, self.backoff_initial_s, self.backoff_max_s)
        self._probe_failures += 1
        self._probe_at = time.monotonic() + delay


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}

