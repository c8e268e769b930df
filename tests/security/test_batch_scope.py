"""A batch id is unique within its deployment, not across the store: deployment B's batch that
reuses an id deployment A already sent is stored as B's own (it was acknowledged `duplicate` and
dropped: one deployment's runtimes could silence another's by guessing or copying ids), while a
replay within a deployment stays `duplicate`. On SQLite and PostgreSQL, over HTTP and through
the Redis stream and its ingest worker."""

from __future__ import annotations

import random

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from controlplane.deployments.service import get_deployment
from controlplane.telemetry import stream
from controlplane.telemetry.models import ShadowSampleRow, TelemetryBatchRow, TokenRecordRow
from tests.support.batches import random_batch
from tests.support.deployments import deploy_for_telemetry
from tests.support.services import REDIS_URL
from tests.support.waiting import patient_get


def _twins(seed: int = 1) -> tuple[dict, dict]:
    """The same batch (id, records, times) sent by deployment a's runtime and by b's."""
    batch = random_batch(random.Random(seed), n=40, deployment="a", shadow_rate=0.5)
    return batch, {**batch, "deployment": "b"}


def _stored(engine, name: str) -> tuple[int, int, int]:
    """(batches, token records, shadow samples) the store holds for deployment `name`."""
    with Session(engine) as session:
        deployment_id = get_deployment(session=session, name=name).id
        return tuple(session.scalar(select(func.count()).select_from(model)
                                    .where(model.deployment_id == deployment_id))
                     for model in (TelemetryBatchRow, TokenRecordRow, ShadowSampleRow))


def test_a_batch_id_reused_by_another_deployment_is_stored_for_both(client, tokens, engine):
    runtime_a = deploy_for_telemetry(client, tokens, engine, name="a")
    runtime_b = deploy_for_telemetry(client, tokens, engine, name="b")
    batch_a, batch_b = _twins()
    first = client.post("/v1/telemetry", json=batch_a, headers=runtime_a)
    assert first.status_code == 202 and first.json()["duplicate"] is False
    second = client.post("/v1/telemetry", json=batch_b, headers=runtime_b)
    assert second.status_code == 202, second.text
    assert second.json()["duplicate"] is False
    shadows = sum("shadow" in record for record in batch_a["records"])
    assert _stored(engine, "a") == _stored(engine, "b") == (1, 40, shadows)
    # a replay within a deployment is still a no-op
    replay = client.post("/v1/telemetry", json=batch_b, headers=runtime_b)
    assert replay.status_code == 202 and replay.json()["duplicate"] is True
    assert _stored(engine, "b") == (1, 40, shadows)
    a_counts = patient_get(client, "/v1/deployments/a/telemetry/count", headers=runtime_a).json()
    b_counts = patient_get(client, "/v1/deployments/b/telemetry/count", headers=runtime_b).json()
    assert a_counts["tokens"] == b_counts["tokens"] == 40


@pytest.fixture
def own_redis():
    """A Redis database of this file's own, emptied of the keys these tests make."""
    import redis

    if not REDIS_URL:
        raise RuntimeError("set EXITPLANE_TEST_REDIS_URL (make test starts Redis)")
    url = REDIS_URL.rsplit("/", 1)[0] + "/11"
    client = redis.Redis.from_url(url)

    def clean() -> None:
        keys = [stream.STREAMS_KEY, stream.stream_key("a"), stream.stream_key("b"),
                *client.scan_iter(match=stream.SEEN_PREFIX + "*")]
        client.delete(*keys)

    clean()
    yield url, client
    clean()


@pytest.mark.redis
def test_the_stream_path_keeps_a_reused_batch_id_per_deployment(settings, engine, tokens,
                                                                  own_redis):
    from fastapi.testclient import TestClient

    from exitplane.app import create_app

    url, redis_client = own_redis
    app = create_app(settings.model_copy(update={"redis_url": url}), engine=engine)
    with TestClient(app) as client:
        runtime_a = deploy_for_telemetry(client, tokens, engine, name="a")
        runtime_b = deploy_for_telemetry(client, tokens, engine, name="b")
        batch_a, batch_b = _twins(2)
        for batch, runtime in ((batch_a, runtime_a), (batch_b, runtime_b)):
            answer = client.post("/v1/telemetry", json=batch, headers=runtime).json()
            assert answer["queued"] is True and answer["duplicate"] is False, answer
        replay = client.post("/v1/telemetry", json=batch_a, headers=runtime_a).json()
        assert replay["duplicate"] is True
        worker = stream.StreamIngestor(redis_client, sessionmaker(bind=engine),
                                       name="scope-worker", count=10, block_ms=10)
        while worker.run_once():
            pass
        assert worker.stats.duplicates == 0 and worker.stats.batches == 2
    app.state.config_delivery.close()
    shadows = sum("shadow" in record for record in batch_a["records"])
    assert _stored(engine, "a") == _stored(engine, "b") == (1, 40, shadows)
