"""One telemetry batch the store cannot take must not hold back the others.

The ingest worker stores a read of many stream entries in one transaction. When that fails on
something about one batch (a sum past a BIGINT, a bug a batch triggers), it stores the entries
one by one: the others are stored and acknowledged, and the batch that fails alone goes to the
dead-letter stream with the reason. When the store is away, nothing is dead-lettered: the
entries stay pending and are read again. And the API refuses an aggregate batch that accounts
for more tokens than a batch may, so no single batch can overflow a sum."""

import os
import random
import sqlite3
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import msgpack
import psycopg
import pytest
import redis
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session, sessionmaker

from controlplane import metrics
from controlplane.deployments.service import get_deployment
from controlplane.telemetry import stream
from controlplane.telemetry.models import Rollup
from exitplane.wire import AGGREGATE_MSGPACK, HISTOGRAM_BINS, INT63, MAX_BATCH_TOKENS
from tests.support.batches import aggregate_batch, post_telemetry, segment_records, telemetry_batch
from tests.support.deployments import FULL, LAYERS, deploy_with_segments
from tests.support.services import REDIS_URL

OWN_REDIS_URL = REDIS_URL.rsplit("/", 1)[0] + "/9" if REDIS_URL else ""
NOW = int(time.time()) // 60 * 60
BUSY, QUIET = NOW - 120, NOW - 60  # the minute a rollup is near its BIGINT's end, and another


def _aggregate(minute: int, first: int, full: int) -> dict:
    """An aggregate batch: `first` tokens leave at the first exit layer, `full` at full depth."""
    cells = [{"minute": minute, "threshold_version": 2, "layer": layer, "exits": exits,
              "histogram": [0] * HISTOGRAM_BINS}
             for layer, exits in ((LAYERS[0], first), (FULL, full)) if exits]
    return aggregate_batch(cells, deployment="mix")


def _minute(seconds: int) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def _tokens(engine, minute: int) -> int:
    """Tokens the store counts in `minute` (all reach the first exit layer)."""
    with Session(engine) as session:
        return session.scalar(select(func.coalesce(func.sum(Rollup.tokens), 0)).where(
            Rollup.minute == _minute(minute), Rollup.layer == LAYERS[0]))


@pytest.fixture
def queue(settings, engine, tokens):
    """(post a batch to the API with a Redis stream, the Redis client, an ingest worker)."""
    from fastapi.testclient import TestClient

    from exitplane.app import create_app

    if not OWN_REDIS_URL:
        raise RuntimeError("set EXITPLANE_TEST_REDIS_URL (make test starts Redis)")
    client = redis.Redis.from_url(OWN_REDIS_URL)  # a database of this module's own
    client.flushdb()
    app = create_app(settings.model_copy(update={"redis_url": OWN_REDIS_URL}), engine=engine)
    with TestClient(app) as api:
        headers = deploy_with_segments(api, tokens, engine)

        def post(payload: dict) -> None:
            answer = post_telemetry(api, headers, payload, AGGREGATE_MSGPACK)
            assert answer.status_code == 202 and answer.json()["queued"], answer.text

        worker = stream.StreamIngestor(client, sessionmaker(bind=engine), name="w", count=10,
                                       block_ms=10, claim_idle_ms=0)
        yield post, client, worker
    app.state.config_delivery.close()
    client.flushdb()


def _dead_letters(client) -> list[dict]:
    return [fields for _, fields in client.xrange(stream.DEAD_LETTER)]


@pytest.mark.redis
@pytest.mark.postgres
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_batch_whose_sum_overflows_is_dead_lettered_and_the_rest_stored(queue, engine):
    post, client, worker = queue
    # The store's count for minute BUSY is 5 short of a BIGINT's end (as a long history of
    # batches into one rollup would leave it).
    with Session(engine) as session:
        deployment_id = get_deployment(session=session, name="mix").id
        session.add(Rollup(deployment_id=deployment_id, version=2, runtime_id="rt-1",
                           minute=_minute(BUSY), layer=LAYERS[0], tokens=INT63 - 5, exits=0))
        session.commit()
    poison = _aggregate(BUSY, 10, 0)
    for payload in (_aggregate(QUIET, 3, 2), poison, _aggregate(QUIET, 4, 3)):
        post(payload)
    before = metrics.dead_lettered_batches.labels("mix")._value.get()

    while worker.run_once():
        pass

    assert _tokens(engine, QUIET) == 12  # both batches read with the poison one are stored
    assert _tokens(engine, BUSY) == INT63 - 5
    [dead] = _dead_letters(client)
    assert msgpack.unpackb(dead[b"aggregate"])["batch_id"] == poison["batch_id"]
    assert dead[b"stream"] == stream.stream_key("mix").encode()
    assert b"DataError" in dead[b"error"] and b"out of range" in dead[b"error"]
    assert worker.stats.dead == 1
    assert metrics.dead_lettered_batches.labels("mix")._value.get() == before + 1
    assert client.xpending(stream.stream_key("mix"), stream.GROUP)["pending"] == 0
    worker.report_lag()
    assert metrics.dead_letter_entries._value.get() == 1

    # Later batches go on being stored.
    post(_aggregate(QUIET, 1, 0))
    while worker.run_once():
        pass
    assert _tokens(engine, QUIET) == 13 and worker.stats.dead == 1


def _failing(monkeypatch, error: Exception, when=lambda batches: True) -> None:
    """Make the worker's store raise `error` for reads `when` picks (the real one otherwise)."""
    real = stream.ingest

    def ingest(*, session, deployment, batches, **kwargs):
        if when(batches):
            raise error
        return real(session=session, deployment=deployment, batches=batches, **kwargs)

    monkeypatch.setattr(stream, "ingest", ingest)


@pytest.mark.redis
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_batch_that_fails_alone_is_dead_lettered_when_others_store(queue, engine,
                                                                     monkeypatch):
    post, client, worker = queue
    bad = _aggregate(QUIET, 6, 0)
    _failing(monkeypatch, KeyError("a bug only this batch triggers"),
             lambda batches: any(batch.batch_id == bad["batch_id"] for batch in batches))
    for payload in (_aggregate(QUIET, 1, 1), bad, _aggregate(QUIET, 2, 0)):
        post(payload)
    while worker.run_once():
        pass
    assert _tokens(engine, QUIET) == 4
    [dead] = _dead_letters(client)
    assert msgpack.unpackb(dead[b"aggregate"])["batch_id"] == bad["batch_id"]
    assert b"KeyError" in dead[b"error"]

    # An operator lists the dead letters, fixes the cause and replays them.
    env = {**os.environ, "EXITPLANE_REDIS_URL": OWN_REDIS_URL}
    listed = _cli(env, "dead-letters")
    assert listed.returncode == 0, listed.stderr
    [line] = listed.stdout.splitlines()
    assert line.split("\t")[1:4] == ["mix", "aggregate", bad["batch_id"]]
    assert "KeyError: 'a bug only this batch triggers'" in line
    monkeypatch.undo()
    replayed = _cli(env, "dead-letters", "--replay")
    assert replayed.returncode == 0 and "moved 1 entries" in replayed.stdout
    while worker.run_once():
        pass
    assert _tokens(engine, QUIET) == 10 and _dead_letters(client) == []
    assert _cli(env, "dead-letters", "--replay").stdout.startswith("moved 0 entries")
    away = _cli({**env, "EXITPLANE_REDIS_URL": "redis://127.0.0.1:9/0"}, "dead-letters")
    assert away.returncode == 2 and away.stderr.count("\n") == 1  # one line, no trace


@pytest.mark.redis
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_dead_letter_is_written_once_when_redis_drops_while_it_is_written(
        queue, engine, monkeypatch):
    """The dead letter and the acknowledgement are one MULTI: Redis lost at that moment
    leaves the entry pending with no dead letter; read again, it is dead-lettered once."""
    post, client, worker = queue
    bad = _aggregate(QUIET, 6, 0)
    _failing(monkeypatch, KeyError("a bug only this batch triggers"),
             lambda batches: any(batch.batch_id == bad["batch_id"] for batch in batches))
    for payload in (_aggregate(QUIET, 1, 1), bad):
        post(payload)
    real_execute = redis.client.Pipeline.execute
    calls = []

    def execute(pipe, *args, **kwargs):
        names = [command[0][0] for command in pipe.command_stack]
        if "XACK" in names and not calls:  # the first acknowledging write is lost
            calls.append(names)
            pipe.reset()
            raise redis.ConnectionError("Connection closed by server.")
        return real_execute(pipe, *args, **kwargs)

    monkeypatch.setattr(redis.client.Pipeline, "execute", execute)
    with pytest.raises(redis.ConnectionError):
        worker.run_once()
    assert calls == [["XADD", "XACK"]]  # the dead letter and its acknowledgement, together
    assert _dead_letters(client) == []
    assert client.xpending(stream.stream_key("mix"), stream.GROUP)["pending"] == 2

    while worker.run_once():
        pass
    [dead] = _dead_letters(client)
    assert msgpack.unpackb(dead[b"aggregate"])["batch_id"] == bad["batch_id"]
    assert _tokens(engine, QUIET) == 2  # the good batch is stored once (its replay a duplicate)
    assert client.xpending(stream.stream_key("mix"), stream.GROUP)["pending"] == 0


def _cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "exitplane"), *args], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.redis
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_when_every_batch_fails_or_the_store_is_away_nothing_is_dead_lettered(
        queue, engine, monkeypatch):
    post, client, worker = queue
    for payload in (_aggregate(QUIET, 1, 1), _aggregate(QUIET, 2, 0)):
        post(payload)

    # A fault of the worker (every batch fails, alone too): they stay pending, and the
    # cycle does not raise, so other streams would go on.
    _failing(monkeypatch, RuntimeError("the worker is broken"))
    assert worker.run_once() == 0
    assert client.xpending(stream.stream_key("mix"), stream.GROUP)["pending"] == 2
    # The store away: the cycle raises (the worker waits and retries), nothing moves.
    _failing(monkeypatch, OperationalError("SELECT 1", {}, Exception("connection refused")))
    with pytest.raises(OperationalError):
        worker.run_once()
    assert client.xpending(stream.stream_key("mix"), stream.GROUP)["pending"] == 2
    assert _dead_letters(client) == [] and worker.stats.dead == 0

    monkeypatch.undo()  # fixed: both are stored when reclaimed
    while worker.run_once():
        pass
    assert _tokens(engine, QUIET) == 4
    assert client.xpending(stream.stream_key("mix"), stream.GROUP)["pending"] == 0


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_batch_may_not_account_for_more_tokens_than_the_cap(client, tokens, engine):
    headers = deploy_with_segments(client, tokens, engine)

    def answer(payload: dict):
        return post_telemetry(client, headers, payload, AGGREGATE_MSGPACK)

    half = MAX_BATCH_TOKENS // 2
    assert answer(_aggregate(QUIET, half, half)).status_code == 202  # exactly the cap
    over = answer(_aggregate(QUIET, half, half + 1))
    assert over.status_code == 422
    assert f"more than a batch may ({MAX_BATCH_TOKENS})" in over.json()["detail"]
    one_cell = answer(_aggregate(QUIET, MAX_BATCH_TOKENS + 1, 0))
    assert one_cell.status_code == 422 and "cells.0.exits" in one_cell.json()["detail"]
    assert _tokens(engine, QUIET) == MAX_BATCH_TOKENS


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_one_runtimes_heartbeat_cannot_keep_the_others_from_the_store(settings, engine,
                                                                       tokens):
    """The wire refuses what the store cannot hold (an applied_checksum that is not one, NUL
    in an error); a held beat the store refuses anyway is dropped alone, the others written."""
    from fastapi.testclient import TestClient

    from controlplane.runtimes.models import Runtime
    from exitplane.app import create_app
    from tests.support.waiting import wait_until

    app = create_app(settings.model_copy(update={"heartbeat_flush_s": 0.2}), engine=engine)
    path = "/v1/deployments/mix/heartbeats"

    def stored(runtime_id: str) -> Runtime:
        with Session(engine) as session:
            return session.scalars(select(Runtime).where(Runtime.runtime_id == runtime_id)).one()

    with TestClient(app) as client:
        headers = deploy_with_segments(client, tokens, engine)
        # first beats: the store path; later ones naming the same applied version are held
        for runtime_id in ("rt-1", "rt-2"):
            assert client.post(path, headers=headers, json={
                "runtime_id": runtime_id, "applied_version": 2}).status_code == 200
        for beat, field in (({"applied_checksum": "x" * 100}, "applied_checksum"),
                            ({"error": "stack\x00trace"}, "error")):
            refused = client.post(path, headers=headers, json={"runtime_id": "rt-1", **beat})
            assert refused.status_code == 422 and field in refused.json()["detail"]
        # A beat the store refuses although the wire took it (here: a column narrowed by a
        # migration this process predates) is dropped alone.
        with engine.begin() as connection:
            connection.exec_driver_sql("ALTER TABLE runtimes ALTER COLUMN error TYPE "
                                       "varchar(10)")
        try:
            assert client.post(path, headers=headers, json={
                "runtime_id": "rt-1", "applied_version": 2,
                "error": "x" * 50}).status_code == 200
            assert client.post(path, headers=headers, json={
                "runtime_id": "rt-2", "applied_version": 2,
                "spooled_batches": 3}).status_code == 200
            wait_until(lambda: stored("rt-2").spooled_batches == 3, 10,
                       "the other runtime's beat to be written")
            assert stored("rt-1").error is None
            assert app.state.heartbeats.flush() == 0  # nothing left held, nothing stuck
        finally:
            app.state.heartbeats.close()
            with engine.begin() as connection:  # the database outlives this test
                connection.exec_driver_sql("ALTER TABLE runtimes ALTER COLUMN error TYPE text")


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_request_id_with_nul_is_refused_by_the_api(client, tokens, engine):
    headers = deploy_with_segments(client, tokens, engine)
    records = segment_records(random.Random(1), 3)
    records[1]["request_id"] = "req\x00-1"
    answer = client.post("/v1/telemetry", headers=headers,
                         json=telemetry_batch(records, deployment="mix"))
    assert answer.status_code == 422 and "request_id" in answer.json()["detail"]
    assert answer.json()["index"] == 1


def test_store_errors_are_told_apart_whichever_layer_raises_them():
    """A COPY runs on the driver's own connection, so its errors come unwrapped: a lost
    connection there must still read as the store away, not as a batch to dead-letter."""
    import sqlite3

    import psycopg
    from sqlalchemy import exc

    from controlplane.db import refused_by_store, store_away

    wrapped = exc.DBAPIError.instance("COPY", {}, psycopg.errors.NumericValueOutOfRange("x"),
                                      psycopg.Error)
    away = [psycopg.OperationalError("server closed the connection"),
            psycopg.errors.DeadlockDetected("deadlock"), sqlite3.OperationalError("locked"),
            exc.OperationalError("SELECT 1", {}, Exception("refused")),
            exc.TimeoutError("pool"), exc.ProgrammingError("SELECT", {}, Exception("no column"))]
    refused = [psycopg.errors.NumericValueOutOfRange("bigint out of range"),
               psycopg.errors.StringDataRightTruncation("too long"), wrapped,
               exc.IntegrityError("INSERT", {}, Exception("fk")), OverflowError("int")]
    assert all(store_away(error) and not refused_by_store(error) for error in away)
    assert all(refused_by_store(error) and not store_away(error) for error in refused)
    assert not store_away(KeyError("bug")) and not refused_by_store(KeyError("bug"))


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize(("error", "status"), [
    # the store away, whichever layer raised it (a COPY runs on the driver's connection)
    (psycopg.OperationalError("server closed the connection unexpectedly"), 503),
    (sqlite3.OperationalError("database is locked"), 503),
    (PoolTimeout("QueuePool limit reached"), 503),
    # Redis refusing writes (a failover's replica, maxmemory): the queue, not the batch
    (redis.ResponseError("READONLY You can't write against a read only replica."), 503),
    # a value the store cannot hold, from the driver itself
    (psycopg.errors.NumericValueOutOfRange("integer out of range"), 422),
    # a fault of ours: 500, which a runtime's shipper sets aside if it persists
    (IntegrityError("INSERT", {}, Exception("violates a constraint")), 500),
], ids=["psycopg-away", "sqlite-locked", "pool-timeout", "redis-readonly", "psycopg-range",
        "integrity"])
def test_the_api_tells_an_outage_from_a_bad_batch_and_from_a_fault(client, tokens, engine,
                                                                    monkeypatch, error, status):
    """A runtime retries a 503 in order, drops a 422 and sets aside a 500 that persists: the
    answer must say which it is, whichever layer raised the store's or Redis's error."""
    from controlplane.telemetry import service

    headers = deploy_with_segments(client, tokens, engine)

    def ingest(**_kwargs):
        raise error

    monkeypatch.setattr(service, "ingest", ingest)
    answer = post_telemetry(client, headers, _aggregate(QUIET, 1, 1), AGGREGATE_MSGPACK)
    assert answer.status_code == status, answer.text
    if status == 503:
        assert answer.headers["retry-after"] == "2"
        assert "unavailable" in answer.json()["detail"]
    elif status == 500:
        assert answer.json() == {"detail": "internal error"}
