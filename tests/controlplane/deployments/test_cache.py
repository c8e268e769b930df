"""The stream path's batch checks read their deployment from a per-process cache: no store read
per telemetry request, a newly published version is still accepted, an unknown one refused."""

import random

import msgpack
import pytest
from sqlalchemy import event
from sqlalchemy.orm import sessionmaker

from controlplane.deployments.cache import DeploymentCache
from controlplane.errors import NotFound
from controlplane.telemetry import stream
from exitplane.wire import RECORDS_MSGPACK
from tests.support.batches import random_batch
from tests.support.deployments import deploy_for_telemetry
from tests.support.services import REDIS_URL
from tests.support.waiting import patient_get

# A database number of its own: the test Redis is shared with other suites.
OWN_REDIS_URL = REDIS_URL.rsplit("/", 1)[0] + "/13" if REDIS_URL else ""


@pytest.fixture
def stream_app(settings, engine):
    import redis
    from fastapi.testclient import TestClient

    from exitplane.app import create_app

    if not OWN_REDIS_URL:
        raise RuntimeError("set EXITPLANE_TEST_REDIS_URL (make test starts Redis)")
    own = redis.Redis.from_url(OWN_REDIS_URL)
    own.flushdb()
    app = create_app(settings.model_copy(update={"redis_url": OWN_REDIS_URL}), engine=engine)
    with TestClient(app) as client:
        yield client
    app.state.config_delivery.close()
    own.flushdb()


def _statements_on(engine, tables: tuple[str, ...]) -> list[str]:
    seen: list[str] = []

    def record(_conn, _cursor, statement, *_args):
        if any(f"FROM {table}" in statement for table in tables):
            seen.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    return seen


@pytest.mark.redis
def test_the_stream_path_checks_batches_without_reading_the_store(stream_app, tokens, engine):
    runtime = deploy_for_telemetry(stream_app, tokens, engine)
    rng = random.Random(14)
    assert stream_app.post("/v1/telemetry", json=random_batch(rng, n=20),
                           headers=runtime).status_code == 202  # fills the cache
    reads = _statements_on(engine, ("deployments", "threshold_sets"))
    for seq in range(1, 4):
        response = stream_app.post("/v1/telemetry", json=random_batch(rng, n=20, seq=seq),
                                   headers=runtime)
        assert response.status_code == 202, response.text
    assert reads == []

    # A version published after the cache was filled: one reload, then accepted.
    op = tokens.headers(tokens.operator)
    published = stream_app.post("/v1/deployments/chat/threshold-sets", headers=op, json={
        "thresholds": {"3": 0.95, "6": 0.9, "9": 0.8}, "reason": "newer"})
    assert published.status_code == 201, published.text
    newer = random_batch(rng, n=5, seq=10)
    for record in newer["records"]:
        record["threshold_version"] = published.json()["version"]
    assert stream_app.post("/v1/telemetry", json=newer, headers=runtime).status_code == 202
    # A version never published is still refused, naming the record.
    unknown = random_batch(rng, n=5, seq=11)
    unknown["records"][2]["threshold_version"] = 99
    refused = stream_app.post("/v1/telemetry", json=unknown, headers=runtime)
    assert refused.status_code == 422
    assert "threshold_version 99 was never published" in refused.text


def test_targets_reload_only_for_unknown_versions(client, tokens, engine):
    deploy_for_telemetry(client, tokens, engine)
    targets = DeploymentCache(sessionmaker(engine))
    first = targets.get("chat", [0, 2])
    assert (first.num_layers, first.exit_layers, first.versions) == (12, (3, 6, 9),
                                                                     frozenset({0, 1, 2}))
    assert targets.get("chat", [2]) is first  # cached
    assert targets.get("chat", [7]) is not first  # unknown: read again (still without 7)
    with pytest.raises(NotFound):
        targets.get("nope", [0])


@pytest.mark.redis
def test_a_msgpack_body_travels_the_stream_as_it_came(stream_app, tokens, engine):
    import redis as redis_client

    runtime = deploy_for_telemetry(stream_app, tokens, engine)
    batch = random_batch(random.Random(3), n=30)
    body = msgpack.packb(batch, use_bin_type=True)
    response = stream_app.post("/v1/telemetry", content=body, headers={
        **runtime, "Content-Type": RECORDS_MSGPACK})
    assert response.status_code == 202, response.text
    own = redis_client.Redis.from_url(OWN_REDIS_URL)
    [(_entry_id, fields)] = own.xrange(stream.stream_key("chat"))
    assert fields[b"batch"] == body  # not decoded and encoded again by the API
    worker = stream.StreamIngestor(own, sessionmaker(engine), name="w", block_ms=10)
    assert worker.run_once() == 1
    counts = patient_get(stream_app, "/v1/deployments/chat/telemetry/count", headers=runtime).json()
    assert counts["records"] == 30 and counts["tokens"] == 30
