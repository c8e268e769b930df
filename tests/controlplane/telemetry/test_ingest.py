"""Telemetry ingestion: whole-batch validation, idempotent replay, rollups that equal a recount,
shadow samples for the calibrator, Redis Streams with consumer crash and reclaim."""

import random
import time
from collections import Counter

import msgpack
import numpy as np
import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controlplane.deployments.service import get_deployment
from controlplane.telemetry import service, stream
from controlplane.telemetry.models import Rollup, RollupHistogram, TokenRecordRow
from tests.support.batches import random_batch
from tests.support.deployments import FULL, LAYERS, deploy_for_telemetry
from tests.support.services import REDIS_URL
from tests.support.waiting import patient_get

OWN_REDIS_URL = REDIS_URL.rsplit("/", 1)[0] + "/14" if REDIS_URL else ""


def _count(client, runtime):
    counts = patient_get(client, "/v1/deployments/chat/telemetry/count", headers=runtime).json()
    return {key: counts[key] for key in ("records", "batches", "shadow_samples")}


def test_batches_are_stored_once_in_json_and_msgpack(client, tokens, engine):
    runtime = deploy_for_telemetry(client, tokens, engine)
    rng = random.Random(1)
    first = random_batch(rng)
    response = client.post("/v1/telemetry", json=first, headers=runtime)
    assert response.status_code == 202, response.text
    assert response.json() == {"batch_id": first["batch_id"], "accepted": 50,
                               "duplicate": False, "queued": False}
    second = random_batch(rng, seq=1)
    packed = client.post("/v1/telemetry", content=msgpack.packb(second), headers={
        **runtime, "Content-Type": "application/msgpack"})
    assert packed.status_code == 202 and packed.json()["duplicate"] is False
    replay = client.post("/v1/telemetry", json=first, headers=runtime)
    assert replay.status_code == 202 and replay.json()["duplicate"] is True
    assert _count(client, runtime)["records"] == 100
    assert _count(client, runtime)["batches"] == 2


@pytest.mark.parametrize(("index", "change", "message"), [
    (3, {"exit_layer": 7}, "record 3: exit_layer 7 is neither an exit layer"),
    (5, {"signal_value": 1.5}, "record 5: signal_value: Input should be less than or equal to 1"),
    (0, {"threshold_version": 9}, "record 0: threshold_version 9 was never published"),
    (2, {"shadow": [{"layer": 3, "signal": 0.5, "matched": True}]},
     "record 2: shadow points must cover exactly"),
])
def test_a_bad_record_refuses_the_whole_batch(client, tokens, engine, index, change, message):
    runtime = deploy_for_telemetry(client, tokens, engine)
    batch = random_batch(random.Random(2), n=10)
    batch["records"][index] = {**batch["records"][index], **change}
    response = client.post("/v1/telemetry", json=batch, headers=runtime)
    assert response.status_code == 422
    assert response.json()["detail"].startswith(message), response.json()
    assert response.json()["index"] == index
    assert _count(client, runtime) == {"records": 0, "batches": 0, "shadow_samples": 0}
    # The id was not used up: the corrected batch is accepted.
    batch["records"][index] = random_batch(random.Random(3), n=1)["records"][0]
    assert client.post("/v1/telemetry", json=batch, headers=runtime).status_code == 202


def test_malformed_bodies_and_foreign_deployments_are_refused(client, tokens, engine):
    runtime = deploy_for_telemetry(client, tokens, engine)
    other = deploy_for_telemetry(client, tokens, engine, name="code")
    batch = random_batch(random.Random(4), n=3)
    garbage = client.post("/v1/telemetry", content=b"\xc1\x00",
                          headers={**runtime, "Content-Type": "application/msgpack"})
    assert garbage.status_code == 422 and "not valid msgpack" in garbage.json()["detail"]
    empty = client.post("/v1/telemetry", json={**batch, "records": []}, headers=runtime)
    assert empty.status_code == 422 and "records" in empty.json()["detail"]
    for runtime_id in ("pod/3", "rt 1", "<b>rt</b>", "-leading-dash", "x" * 129):
        bad_id = client.post("/v1/telemetry", json={**batch, "runtime_id": runtime_id},
                             headers=runtime)
        assert bad_id.status_code == 422 and "runtime_id" in bad_id.json()["detail"], runtime_id
    foreign = client.post("/v1/telemetry", json=batch, headers=other)
    assert foreign.status_code == 403
    assert client.post("/v1/telemetry", json=batch).status_code == 401


def test_rollups_equal_a_recount_of_raw_rows(client, tokens, engine):
    runtime = deploy_for_telemetry(client, tokens, engine)
    rng = random.Random(5)
    base = time.time() - 600
    sent = [random_batch(rng, n=80, seq=s, ts=base + s * 40, runtime_id=f"rt-{s % 2}")
            for s in range(12)]
    for batch in sent:
        assert client.post("/v1/telemetry", json=batch, headers=runtime).status_code == 202
    thresholds = {0: np.ones(3), 2: np.array([0.9, 0.8, 0.7])}
    exits: Counter = Counter()
    reached: Counter = Counter()
    shadow = Counter()
    for batch in sent:
        for record in batch["records"]:
            minute = int(record["ts"]) - int(record["ts"]) % 60
            key = (record["threshold_version"], batch["runtime_id"], minute)
            exits[(*key, record["exit_layer"])] += 1
            for layer in [*LAYERS, FULL]:
                if layer <= record["exit_layer"]:
                    reached[(*key, layer)] += 1
            if "shadow" in record:
                signals = np.array([p["signal"] for p in record["shadow"]])
                over = np.nonzero(signals > thresholds[record["threshold_version"]])[0]
                for position, point in enumerate(record["shadow"]):
                    shadow[(*key, point["layer"], "total")] += 1
                    shadow[(*key, point["layer"], "match")] += point["matched"]
                    if len(over) and over[0] == position:
                        shadow[(*key, point["layer"], "policy")] += 1
                        shadow[(*key, point["layer"], "wrong")] += not point["matched"]
    with Session(engine) as session:
        rows = session.scalars(select(Rollup)).all()
        assert sum(r.tokens for r in rows if r.layer == LAYERS[0]) == 80 * 12
        for row in rows:
            key = (row.version, row.runtime_id, int(row.minute.timestamp()), row.layer)
            assert row.tokens == reached[key]
            assert row.exits == exits[key]
            assert row.shadow_total == shadow[(*key, "total")]
            assert row.shadow_matches == shadow[(*key, "match")]
            assert row.policy_exits == shadow[(*key, "policy")]
            assert row.policy_mismatches == shadow[(*key, "wrong")]
        assert {k for k, v in reached.items() if v} == {
            (r.version, r.runtime_id, int(r.minute.timestamp()), r.layer) for r in rows}
        raw = session.scalar(select(func.count()).select_from(TokenRecordRow))
        histogram_total = session.scalar(select(func.sum(RollupHistogram.count)))
        assert raw == histogram_total == 80 * 12

    rates = patient_get(client, "/v1/deployments/chat/telemetry/exit-rates", headers=runtime,
                        params={"since": "2000-01-01T00:00:00Z"}).json()
    assert sum(p["exits"] for p in rates) == 80 * 12
    quality = patient_get(client, "/v1/deployments/chat/telemetry/disagreement", headers=runtime,
                          params={"since": "2000-01-01T00:00:00Z"}).json()
    total_shadow = sum(v for k, v in shadow.items() if k[-1] == "total" and k[-2] == LAYERS[0])
    assert sum(p["shadow_tokens"] for p in quality) == total_shadow
    assert sum(p["mismatches"] for p in quality) == sum(
        v for k, v in shadow.items() if k[-1] == "wrong")
    histogram = patient_get(client, "/v1/deployments/chat/telemetry/signal-histogram",
                            headers=runtime, params={"since": "2000-01-01T00:00:00Z"}).json()
    assert sum(sum(bins) for bins in histogram.values()) == 80 * 12


def test_shadow_samples_read_back_in_exit_layer_order(client, tokens, engine):
    runtime = deploy_for_telemetry(client, tokens, engine)
    # its runtime applied version 2 (the batch's tokens are stamped 0 or 2): all of them count
    assert client.post("/v1/deployments/chat/heartbeats", headers=runtime, json={
        "runtime_id": "rt-1", "applied_version": 2}).status_code == 200
    batch = random_batch(random.Random(6), n=40, shadow_rate=0.5)
    client.post("/v1/telemetry", json=batch, headers=runtime)
    sent = [r["shadow"] for r in batch["records"] if "shadow" in r]
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        from datetime import UTC, datetime

        signals, matched = service.shadow_samples(session=session, deployment=deployment,
                                                  since=datetime(2000, 1, 1, tzinfo=UTC))
    assert signals.shape == matched.shape == (len(sent), 3)
    np.testing.assert_allclose(signals, [[p["signal"] for p in s] for s in sent], rtol=1e-6)
    assert matched.tolist() == [[p["matched"] for p in s] for s in sent]


def test_purge_removes_old_rows_and_keeps_recent(client, tokens, engine):
    from datetime import UTC, datetime, timedelta

    runtime = deploy_for_telemetry(client, tokens, engine)
    old = random_batch(random.Random(7), n=20, ts=time.time() - 10 * 86400)
    new = random_batch(random.Random(8), n=20, seq=1)
    for batch in (old, new):
        client.post("/v1/telemetry", json=batch, headers=runtime)
    with Session(engine) as session:
        result = service.purge(session=session,
                               older_than=datetime.now(UTC) - timedelta(days=3))
        session.commit()
    assert result["token_records"] == 20
    assert _count(client, runtime)["records"] == 20


def test_metrics_count_ingestion(client, tokens, engine):
    runtime = deploy_for_telemetry(client, tokens, engine)
    client.post("/v1/telemetry", json=random_batch(random.Random(9), n=7), headers=runtime)
    text = client.get("/metrics").text
    assert 'exitplane_ingested_records_total{deployment="chat"}' in text


@pytest.fixture
def redis_client():
    import redis

    if not REDIS_URL:
        raise RuntimeError("set EXITPLANE_TEST_REDIS_URL (make test starts Redis)")
    # A database of this module's own: under pytest-xdist another worker's test may use /0.
    client = redis.Redis.from_url(OWN_REDIS_URL)
    client.flushdb()
    yield client
    client.flushdb()


@pytest.fixture
def redis_app(settings, engine, redis_client):
    from fastapi.testclient import TestClient

    from exitplane.app import create_app

    app = create_app(settings.model_copy(update={"redis_url": OWN_REDIS_URL}), engine=engine)
    with TestClient(app) as client:
        yield client
    app.state.config_delivery.close()


@pytest.mark.redis
def test_stream_path_with_consumer_crash_and_reclaim(redis_app, redis_client, tokens, engine):
    from sqlalchemy.orm import sessionmaker

    runtime = deploy_for_telemetry(redis_app, tokens, engine)
    rng = random.Random(10)
    batches = [random_batch(rng, n=25, seq=s) for s in range(6)]
    for batch in batches:
        response = redis_app.post("/v1/telemetry", json=batch, headers=runtime)
        assert response.status_code == 202 and response.json()["queued"] is True
    replay = redis_app.post("/v1/telemetry", json=batches[0], headers=runtime)
    assert replay.json()["duplicate"] is True
    assert redis_client.xlen(stream.stream_key("chat")) == 6
    assert _count(redis_app, runtime)["records"] == 0  # queued, not yet stored

    factory = sessionmaker(bind=engine, expire_on_commit=False)
    crashed = stream.StreamIngestor(redis_client, factory, name="worker-a", count=2,
                                    block_ms=10, claim_idle_ms=60_000)
    crashed.streams()
    # worker-a takes two entries and dies before storing or acknowledging them ...
    taken = redis_client.xreadgroup(stream.GROUP, "worker-a",
                                    {stream.stream_key("chat"): ">"}, count=2)
    assert len(taken[0][1]) == 2
    # ... and takes one more, stores it, and dies before acknowledging it.
    [(_, [(_entry_id, fields)])] = redis_client.xreadgroup(
        stream.GROUP, "worker-a", {stream.stream_key("chat"): ">"}, count=1)
    from exitplane.wire import TelemetryBatch

    with factory() as session:
        service.ingest(session=session, deployment=get_deployment(session=session, name="chat"),
                       batches=[TelemetryBatch.model_validate(msgpack.unpackb(fields[b"batch"]))])
        session.commit()

    survivor = stream.StreamIngestor(redis_client, factory, name="worker-b", count=10,
                                     block_ms=10, claim_idle_ms=0)
    while survivor.run_once():
        pass
    assert survivor.stats.reclaimed == 3
    assert survivor.stats.duplicates == 1
    counts = _count(redis_app, runtime)
    assert counts["records"] == 6 * 25 and counts["batches"] == 6
    assert redis_client.xpending(stream.stream_key("chat"), stream.GROUP)["pending"] == 0


@pytest.mark.postgres
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_postgres_daily_partitions_take_rows_and_retention_drops_them(client, tokens, engine):
    from datetime import UTC, datetime, timedelta

    from sqlalchemy import text

    runtime = deploy_for_telemetry(client, tokens, engine)
    day = datetime.now(UTC) - timedelta(days=5)
    with Session(engine) as session:
        service.ensure_partitions(session=session, day=day, days_ahead=0)
        session.commit()
    client.post("/v1/telemetry", json=random_batch(random.Random(11), n=15, ts=day.timestamp()),
                headers=runtime)
    name = f"token_records_p{day:%Y%m%d}"
    with Session(engine) as session:
        assert session.scalar(text(f"SELECT count(*) FROM {name}")) == 15
        result = service.purge(session=session, older_than=datetime.now(UTC) - timedelta(days=2))
        session.commit()
        assert result["partitions_dropped"] == 2  # token_records and shadow_samples
        assert session.scalar(text("SELECT to_regclass(:n)"), {"n": name}) is None
