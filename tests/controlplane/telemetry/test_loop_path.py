"""A small telemetry batch from a token and deployment the API has cached is served on the event
loop: the rate take from the headers, then the stream append; the answers, the stream
and the shared rate bucket are those of the worker-thread path and of the FastAPI route, and
anything that would read the store still goes to a worker thread."""

from __future__ import annotations

import random
import uuid

import msgpack
import pytest
from fastapi.testclient import TestClient

from controlplane.edge import telemetry_fast_path as fast_path
from controlplane.telemetry import stream
from exitplane.app import create_app
from exitplane.wire import AGGREGATE_MSGPACK, HISTOGRAM_BINS, RECORDS_MSGPACK
from tests.support.batches import random_batch
from tests.support.deployments import deploy_for_telemetry
from tests.support.services import REDIS_URL

pytestmark = pytest.mark.redis

# Databases of this module's own: the loop path's app and the route's.
OWN_REDIS_URLS = [REDIS_URL.rsplit("/", 1)[0] + f"/{number}" for number in (5, 6)] \
    if REDIS_URL else []


@pytest.fixture
def threads(monkeypatch) -> list[bytes]:
    """The bodies of the telemetry requests that `store_batch` took on a worker thread."""
    taken: list[bytes] = []
    serve = fast_path.store_batch

    def counted(state, principal, body, content_type, charge=None):
        taken.append(body)
        return serve(state, principal, body, content_type, charge)

    monkeypatch.setattr(fast_path, "store_batch", counted)
    return taken


@pytest.fixture
def apps(settings, engine):
    """Start (loop path app, route app) on one store, each with a Redis database of its own."""
    import redis

    if not OWN_REDIS_URLS:
        raise RuntimeError("set EXITPLANE_TEST_REDIS_URL (make test starts Redis)")
    made, own = [], [redis.Redis.from_url(url) for url in OWN_REDIS_URLS]

    def start(**update):
        for client in own:
            client.flushdb()
        pair = []
        for url, fast in zip(OWN_REDIS_URLS, (True, False), strict=True):
            app = create_app(settings.model_copy(update={
                **update, "redis_url": url, "telemetry_fast_path": fast}), engine=engine)
            client = TestClient(app).__enter__()
            made.append((app, client))
            pair.append(client)
        return pair

    yield start, own
    for app, client in made:
        client.__exit__(None, None, None)
        app.state.config_delivery.close()
    for client in own:
        client.flushdb()


def _aggregate(batch_id: str, *, deployment: str = "chat", version: int = 2) -> bytes:
    return msgpack.packb({
        "batch_id": batch_id, "deployment": deployment, "runtime_id": "rt-1", "seq": 0,
        "num_layers": 12, "raw_sample_rate": 0.01, "cells": [{
            "minute": 1_700_000_040, "threshold_version": version, "layer": 3, "exits": 10,
            "histogram": [0] * (HISTOGRAM_BINS - 1) + [10]}]}, use_bin_type=True)


def _shape(response) -> tuple:
    return (response.status_code, response.json(),
            {name: response.headers.get(name) for name in ("retry-after", "www-authenticate")})


def _limited_shape(response) -> tuple:
    """Status, Retry-After and the detail's words: the detail's tenths of a second follow the
    clock between two requests, so the wait itself is compared as the rounded header."""
    detail = response.json()["detail"]
    return (response.status_code, response.headers.get("retry-after"), detail.split(";")[0])


def test_the_loop_path_answers_as_the_route_does(apps, tokens, engine, threads):
    start, own = apps
    loop, route = start()
    runtime = deploy_for_telemetry(loop, tokens, engine)
    other = deploy_for_telemetry(loop, tokens, engine, name="code")
    operator = tokens.headers(tokens.operator)
    # Fills this process's token and deployment caches (a cold cache reads on a thread).
    warm = loop.post("/v1/telemetry", content=_aggregate(uuid.uuid4().hex), headers={
        **runtime, "Content-Type": AGGREGATE_MSGPACK})
    assert warm.status_code == 202 and len(threads) == 1
    threads.clear()
    ids = [uuid.uuid4().hex for _ in range(3)]
    records = random_batch(random.Random(5), n=40)
    cases = [
        (runtime, AGGREGATE_MSGPACK, _aggregate(ids[0])),
        (runtime, AGGREGATE_MSGPACK, _aggregate(ids[0])),  # a replay: duplicate
        (runtime, RECORDS_MSGPACK, msgpack.packb(records, use_bin_type=True)),
        (runtime, RECORDS_MSGPACK, b"\xc1 not msgpack"),
        (runtime, AGGREGATE_MSGPACK, _aggregate(ids[1], version=99)),  # never published
        (runtime, AGGREGATE_MSGPACK, _aggregate(ids[2], deployment="code")),  # not its own
        (other, AGGREGATE_MSGPACK, _aggregate(ids[2], deployment="code")),
        (operator, AGGREGATE_MSGPACK, _aggregate(uuid.uuid4().hex)),  # operators reach all
        (runtime, "application/vnd.exitplane.future+msgpack", _aggregate(uuid.uuid4().hex)),
    ]
    answers = {}
    for name, client in (("loop", loop), ("route", route)):
        answers[name] = [_shape(client.post("/v1/telemetry", content=body, headers={
            **headers, "Content-Type": content_type})) for headers, content_type, body in cases]
    assert answers["loop"] == answers["route"]
    assert [status for status, _, _ in answers["loop"]] == [
        202, 202, 202, 422, 422, 403, 202, 202, 415]
    assert [body["duplicate"] for _, body, _ in answers["loop"][:3]] == [False, True, False]
    # Stored on a worker thread: only what needed the store, version 99 (it may have been
    # published since), the `code` deployment (not cached yet) and `other`'s first batch (its
    # token registers its runtime id in the store first). Every other answer, the bad
    # bodies' too, came from the loop.
    assert threads == [cases[4][2], cases[5][2], cases[6][2]], answers
    # The stream holds each accepted batch once, the msgpack body as it came.
    entries = own[0].xrange(stream.stream_key("chat"))
    assert len(entries) == 4  # the warm-up, ids[0] once, the records batch, the operator's
    assert entries[2][1][b"batch"] == msgpack.packb(records, use_bin_type=True)
    assert len(own[0].xrange(stream.stream_key("code"))) == 1


def test_a_large_body_or_a_cold_cache_goes_to_a_worker_thread(apps, tokens, engine, threads):
    start, own = apps
    loop, _ = start()
    runtime = deploy_for_telemetry(loop, tokens, engine)
    headers = {**runtime, "Content-Type": RECORDS_MSGPACK}
    small = msgpack.packb(random_batch(random.Random(1), n=20), use_bin_type=True)
    large = msgpack.packb(random_batch(random.Random(2), n=600, seq=1), use_bin_type=True)
    assert len(small) < fast_path.SMALL_BODY_BYTES < len(large)
    for body in (small, large, msgpack.packb(random_batch(random.Random(3), n=20, seq=2),
                                             use_bin_type=True)):
        assert loop.post("/v1/telemetry", content=body, headers=headers).status_code == 202
    assert threads == [small, large]  # the cold first and the large one
    assert len(own[0].xrange(stream.stream_key("chat"))) == 3


def test_the_loop_path_and_the_threads_take_from_one_rate_bucket(apps, tokens, engine,
                                                                 threads):
    start, own = apps
    loop, route = start(rate_limit_ingest_per_s=0.05)  # a burst of 1, then one per 20 s
    runtime = deploy_for_telemetry(loop, tokens, engine)
    headers = {**runtime, "Content-Type": AGGREGATE_MSGPACK}
    first = loop.post("/v1/telemetry", content=_aggregate(uuid.uuid4().hex), headers=headers)
    assert first.status_code == 202 and len(threads) == 1  # cold: on a thread
    past = loop.post("/v1/telemetry", content=_aggregate(uuid.uuid4().hex), headers=headers)
    bad = loop.post("/v1/telemetry", content=b"\xc1", headers=headers)
    assert len(threads) == 1  # both answered on the loop
    assert (past.status_code, bad.status_code) == (429, 429)  # past the rate whatever the body
    assert past.headers["retry-after"] == "20" and "too many ingest requests" in past.text
    # Nothing past the rate reached the stream.
    assert len(own[0].xrange(stream.stream_key("chat"))) == 1
    # The route, on its own Redis, answers the same two requests the same way.
    assert route.post("/v1/telemetry", content=_aggregate(uuid.uuid4().hex),
                      headers=headers).status_code == 202
    assert _limited_shape(route.post("/v1/telemetry", content=_aggregate(uuid.uuid4().hex),
                                     headers=headers)) == _limited_shape(past)
    assert _limited_shape(route.post("/v1/telemetry", content=b"\xc1",
                                     headers=headers)) == _limited_shape(bad)
