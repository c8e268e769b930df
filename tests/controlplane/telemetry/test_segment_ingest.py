"""Traffic segments on the write path: every stored token keeps its segment, the
rollups add up per segment exactly (record and aggregate batches, HTTP and Redis stream),
replays add nothing, names not in use (undeclared, or past the cap where the deployment
registers names from telemetry) land in `default`, and a shadow token's policy columns use its
segment's own thresholds."""

import logging
import random
import time
import uuid
from collections import Counter

import msgpack
import pytest
from sqlalchemy import event, func, select
from sqlalchemy.orm import Session, sessionmaker

from controlplane import metrics
from controlplane.deployments.segments import admit_segments, declare_segment, known_segments
from controlplane.deployments.service import get_deployment
from controlplane.telemetry import admission, service, stream
from controlplane.telemetry.models import (
    Rollup,
    RollupHistogram,
    ShadowSampleRow,
    TokenRecordRow,
)
from exitplane.client.aggregate import Aggregator
from exitplane.wire import AGGREGATE_MSGPACK, AggregateBatch, TelemetryBatch, TokenRecord
from tests.support.batches import expected_exits, segment_of, segment_records, telemetry_batch
from tests.support.deployments import FULL, LAYERS, SEGMENTS, deploy_with_segments
from tests.support.services import REDIS_URL


def _batch(records: list[dict], **fields) -> dict:
    """A record batch of deployment `mix` (unless `fields` names another)."""
    return telemetry_batch(records, **{"deployment": "mix", **fields})


def _rollups(engine) -> dict[tuple[str, int], tuple[int, ...]]:
    """(segment, layer) -> summed counters over minutes, versions and runtimes."""
    with Session(engine) as session:
        rows = session.execute(
            select(Rollup.segment, Rollup.layer, func.sum(Rollup.tokens), func.sum(Rollup.exits),
                   func.sum(Rollup.shadow_total), func.sum(Rollup.policy_exits),
                   func.sum(Rollup.policy_mismatches))
            .group_by(Rollup.segment, Rollup.layer))
        return {(row[0], row[1]): tuple(int(value) for value in row[2:]) for row in rows}


def _histograms(engine) -> Counter:
    with Session(engine) as session:
        rows = session.execute(select(RollupHistogram.segment, RollupHistogram.layer,
                                      func.sum(RollupHistogram.count))
                               .group_by(RollupHistogram.segment, RollupHistogram.layer))
        return Counter({(row[0], row[1]): int(row[2]) for row in rows})


def _stored_segments(engine, model) -> Counter:
    with Session(engine) as session:
        return Counter(dict(session.execute(
            select(model.segment, func.count()).group_by(model.segment)).all()))


def test_a_mixed_segment_record_batch_lands_per_segment_and_a_replay_adds_nothing(
        client, tokens, engine):
    runtime = deploy_with_segments(client, tokens, engine)
    records = segment_records(random.Random(3), 150)
    batch = _batch(records)
    response = client.post("/v1/telemetry", content=msgpack.packb(batch), headers={
        **runtime, "Content-Type": "application/msgpack"})
    assert response.status_code == 202, response.text

    rollups = _rollups(engine)
    for key, (reached, exits) in expected_exits(records).items():
        assert rollups[key][:2] == (reached, exits), key
    per_segment = Counter(segment_of(record) for record in records)
    assert {segment: rollups[(segment, LAYERS[0])][0] for segment in SEGMENTS} == per_segment
    assert sum(rollups[(segment, LAYERS[0])][0] for segment in SEGMENTS) == len(records)
    assert _stored_segments(engine, TokenRecordRow) == per_segment
    assert _stored_segments(engine, ShadowSampleRow) == Counter(
        segment_of(record) for record in records if "shadow" in record)
    assert sum(_histograms(engine).values()) == len(records)  # every token has a signal here
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="mix")
        assert known_segments(session=session, deployment_id=deployment.id) == ["chat", "code"]

    replay = client.post("/v1/telemetry", json=batch, headers=runtime)
    assert replay.status_code == 202 and replay.json()["duplicate"] is True
    assert _rollups(engine) == rollups
    assert _stored_segments(engine, TokenRecordRow) == per_segment


def test_an_aggregate_batch_lands_per_segment_exactly(client, tokens, engine):
    runtime = deploy_with_segments(client, tokens, engine)
    records = segment_records(random.Random(4), 120, shadow_rate=0.0)
    aggregator = Aggregator(exit_layers=LAYERS, num_layers=FULL)
    for record in records:
        assert aggregator.add(TokenRecord.model_validate(record))
    cells = aggregator.cut()
    assert {cell.segment for cell in cells} == set(SEGMENTS)
    aggregate = AggregateBatch(batch_id=uuid.uuid4().hex, deployment="mix", runtime_id="rt-1",
                               seq=0, num_layers=FULL, raw_sample_rate=0.0, cells=cells)
    body = msgpack.packb(aggregate.model_dump(mode="json"))
    headers = {**runtime, "Content-Type": AGGREGATE_MSGPACK}
    response = client.post("/v1/telemetry", content=body, headers=headers)
    assert response.status_code == 202 and response.json()["accepted"] == len(records)

    rollups = _rollups(engine)
    for key, (reached, exits) in expected_exits(records).items():
        assert rollups[key][:2] == (reached, exits), key
    histograms = _histograms(engine)
    for segment in SEGMENTS:
        for layer in [*LAYERS, FULL]:
            assert histograms[(segment, layer)] == sum(
                sum(cell.histogram) for cell in cells
                if cell.segment == segment and cell.layer == layer)
    assert client.post("/v1/telemetry", content=body, headers=headers).json()["duplicate"]
    assert _rollups(engine) == rollups and _histograms(engine) == histograms


def test_policy_counts_use_the_shadow_tokens_segment_map(session, engine, client, tokens):
    deploy_with_segments(client, tokens, engine)
    deployment = get_deployment(session=session, name="mix")
    now = time.time()

    def shadow(segment: str, signal: float) -> dict:
        record = {"threshold_version": 2, "request_id": "r", "position": 0, "exit_layer": FULL,
                  "signal_value": 0.99, "latency_us": 1, "ts": now,
                  "shadow": [{"layer": k, "signal": signal, "matched": False} for k in LAYERS]}
        return record | ({"segment": segment} if segment != "default" else {})

    # 0.5 beats code's own 0.1 at layer 3 but none of the default map's 0.9/0.8/0.7: a code
    # token counted with the default map would show no policy exit at all.
    records = [shadow("code", 0.5)] * 4 + [shadow("default", 0.5)] * 3 + \
        [shadow("chat", 0.95)] * 2  # chat has no map of its own: the default's 0.9 applies
    batch = TelemetryBatch.model_validate(_batch(records))
    service.check_batch(deployment=deployment, batch=service.BatchColumns.from_model(batch),
                        known_versions={0, 1, 2})
    service.ingest(session=session, deployment=deployment, batches=[batch])
    session.commit()
    rollups = _rollups(engine)
    # (tokens, exits, shadow_total, policy_exits, policy_mismatches)
    assert rollups[("code", 3)][2:] == (4, 4, 4)
    assert rollups[("code", 6)][3:] == (0, 0)  # the policy's first exit only
    assert all(rollups[("default", layer)][3:] == (0, 0) for layer in LAYERS)
    assert rollups[("chat", 3)][2:] == (2, 2, 2)


def test_names_not_in_use_are_stored_as_default_and_logged_once_per_interval(
        session, engine, client, tokens, caplog, monkeypatch):
    monkeypatch.setattr(admission, "_undeclared", {})  # no line of an earlier test counts
    deploy_with_segments(client, tokens, engine, declare=())  # declares `code`
    deployment = get_deployment(session=session, name="mix")
    for index in range(15):  # 16 with `code`: the default cap
        declare_segment(session=session, deployment=deployment, name=f"s{index:02d}",
                        actor="test")
    session.commit()
    records = segment_records(random.Random(5), 60, segments=("default", "late", "code", "s07"))
    first, second = _batch(records[:30]), _batch(records[30:], seq=1)
    with caplog.at_level(logging.WARNING, logger="exitplane.telemetry"):
        for batch in (first, second):
            service.ingest(session=session, deployment=deployment,
                           batches=[TelemetryBatch.model_validate(batch)])
            session.commit()
    lines = [r.getMessage() for r in caplog.records if "'default'" in r.getMessage()]
    late = sum(segment_of(record) == "late" for record in records[:30])
    assert lines == [f"deployment {deployment.id}: {late} tokens in 1 batches were stored as "
                     "segment 'default' since the last such line: their segments are not in use "
                     "(up to 1 such names in one batch, e.g. 'late'); declare the ones you want "
                     "(exitplane segments declare)"]
    sent = Counter(segment_of(record) for record in records)
    stored = {"default": sent["default"] + sent["late"], "code": sent["code"], "s07": sent["s07"]}
    assert _stored_segments(engine, TokenRecordRow) == stored
    rollups = _rollups(engine)
    assert {segment: rollups[(segment, LAYERS[0])][0] for segment in stored} == stored

    # An aggregate batch of the same tokens: `late` cells fold into `default`'s, exactly.
    aggregator = Aggregator(exit_layers=LAYERS, num_layers=FULL)
    for record in records:
        aggregator.add(TokenRecord.model_validate(record))
    cells = aggregator.cut()
    assert {cell.segment for cell in cells} == {"default", "late", "code", "s07"}
    service.ingest(session=session, deployment=deployment, batches=[AggregateBatch(
        batch_id=uuid.uuid4().hex, deployment="mix", runtime_id="rt-1", seq=2, num_layers=FULL,
        raw_sample_rate=0.0, cells=cells)])
    session.commit()
    rollups = _rollups(engine)
    assert {segment: rollups[(segment, LAYERS[0])][0] for segment in stored} == {
        segment: 2 * count for segment, count in stored.items()}
    assert not any(segment == "late" for segment, _ in rollups)
    assert not any(segment == "late" for segment, _ in _histograms(engine))
    assert "late" not in known_segments(session=session, deployment_id=deployment.id)


def test_known_names_read_nothing_and_a_rolled_back_admission_is_not_remembered(
        session, engine, client, tokens):
    deploy_with_segments(client, tokens, engine, declare=(), auto=True)
    deployment = get_deployment(session=session, name="mix")
    rng = random.Random(6)
    batch = TelemetryBatch.model_validate(_batch(segment_records(rng, 20, segments=("chat",))))
    savepoint = session.begin_nested()
    service.ingest(session=session, deployment=deployment, batches=[batch])
    savepoint.commit()  # a savepoint's commit is not the transaction's
    session.rollback()  # the batch and its registration are gone ...
    assert known_segments(session=session, deployment_id=deployment.id) == ["code"]
    service.ingest(session=session, deployment=deployment, batches=[batch])
    session.commit()  # ... so storing it again registers `chat` here
    assert known_segments(session=session, deployment_id=deployment.id) == ["chat", "code"]

    def store(segments) -> list[str]:
        """Store a batch of `segments`; the SQL it ran."""
        statements: list[str] = []
        listener = lambda *args: statements.append(args[2])  # noqa: E731
        event.listen(engine, "before_cursor_execute", listener)
        try:
            again = TelemetryBatch.model_validate(
                _batch(segment_records(rng, 20, segments=segments)))
            service.ingest(session=session, deployment=deployment, batches=[again])
            session.commit()
        finally:
            event.remove(engine, "before_cursor_execute", listener)
        assert statements
        return [sql for sql in statements if "deployment_segments" in sql]

    # `chat` was registered by the last commit, so this process reads the registry again
    assert store(("chat", "code")) != []
    assert store(("code", "chat", "default")) == []  # read within FRESH_S: no registry read
    assert _stored_segments(engine, TokenRecordRow) == {"chat": 20 + 10 + 7, "code": 10 + 7,
                                                        "default": 6}


def _overflow_counted(deployment: str = "mix") -> float:
    """exitplane_segment_overflow_tokens_total{deployment} of this process so far."""
    return metrics.registry.get_sample_value("exitplane_segment_overflow_tokens_total",
                                             {"deployment": deployment}) or 0.0


def _fill_the_cap(engine, name: str = "mix") -> None:
    """Declare 15 names besides `code`: the deployment is at the default cap of 16."""
    with Session(engine) as session:
        deployment = get_deployment(session=session, name=name)
        for index in range(15):
            declare_segment(session=session, deployment=deployment, name=f"s{index:02d}",
                            actor="test")
        session.commit()


def _aggregate_of(records: list[dict], seq: int, runtime_id: str = "rt-1") -> AggregateBatch:
    aggregator = Aggregator(exit_layers=LAYERS, num_layers=FULL)
    for record in records:
        assert aggregator.add(TokenRecord.model_validate(record))
    return AggregateBatch(batch_id=uuid.uuid4().hex, deployment="mix", runtime_id=runtime_id,
                          seq=seq, num_layers=FULL, raw_sample_rate=0.0, cells=aggregator.cut())


def test_tokens_past_the_cap_are_counted_in_prometheus_once_each(client, tokens, engine):
    runtime = deploy_with_segments(client, tokens, engine, declare=(), auto=True)
    _fill_the_cap(engine)
    before = _overflow_counted()
    records = segment_records(random.Random(8), 60, segments=("default", "late", "code", "later"))
    past_cap = sum(segment_of(record) in {"late", "later"} for record in records)
    batch = _batch(records)
    assert client.post("/v1/telemetry", json=batch, headers=runtime).status_code == 202
    assert _overflow_counted() - before == past_cap == 30
    # a replay stores nothing and counts nothing; names within the cap never count
    assert client.post("/v1/telemetry", json=batch, headers=runtime).json()["duplicate"]
    within = _batch(segment_records(random.Random(9), 20, segments=("code", "s03")), seq=1)
    assert client.post("/v1/telemetry", json=within, headers=runtime).status_code == 202
    assert _overflow_counted() - before == past_cap

    # the same tokens as an aggregate batch: its relabelled cells count their exits
    aggregate = _aggregate_of(records, seq=2)
    assert {cell.segment for cell in aggregate.cells} >= {"late", "later"}
    response = client.post("/v1/telemetry", headers={
        **runtime, "Content-Type": AGGREGATE_MSGPACK},
        content=msgpack.packb(aggregate.model_dump(mode="json")))
    assert response.status_code == 202, response.text
    assert _overflow_counted() - before == 2 * past_cap
    assert _stored_segments(engine, TokenRecordRow)["default"] == 15 + past_cap
    assert 'exitplane_segment_overflow_tokens_total{deployment="mix"}' in \
        client.get("/metrics").text


def test_a_deployment_s_overflow_series_exists_at_zero_from_its_first_batch(
        client, tokens, engine):
    name = f"calm-{uuid.uuid4().hex[:8]}"  # a series no other test of this process touched
    runtime = deploy_with_segments(client, tokens, engine, name=name)
    samples = lambda: metrics.registry.get_sample_value(  # noqa: E731
        "exitplane_segment_overflow_tokens_total", {"deployment": name})
    assert samples() is None
    batch = _batch(segment_records(random.Random(12), 10), deployment=name)
    assert client.post("/v1/telemetry", json=batch, headers=runtime).status_code == 202
    assert samples() == 0.0  # so a rate over it sees the first overflow


@pytest.fixture
def own_redis():
    """A Redis database of this test file's own (the stream keys are shared names): emptied
    of the keys these tests make, before and after."""
    import redis

    if not REDIS_URL:
        raise RuntimeError("set EXITPLANE_TEST_REDIS_URL (make test starts Redis)")
    url = REDIS_URL.rsplit("/", 1)[0] + "/10"
    client = redis.Redis.from_url(url)

    def clean() -> None:
        keys = [stream.STREAMS_KEY, stream.stream_key("mix"),
                *client.scan_iter(match=stream.SEEN_PREFIX + "*")]
        client.delete(*keys)

    clean()
    yield url, client
    clean()


@pytest.mark.redis
def test_the_stream_path_stores_segments_in_the_ingest_worker(
        settings, engine, tokens, own_redis):
    from fastapi.testclient import TestClient

    from exitplane.app import create_app

    url, redis_client = own_redis
    app = create_app(settings.model_copy(update={"redis_url": url}), engine=engine)
    with TestClient(app) as client:
        runtime = deploy_with_segments(client, tokens, engine, declare=(), auto=True)
        rng = random.Random(7)
        records = segment_records(rng, 90, segments=("default", "chat", "code", "tools"))
        batches = [_batch(records[:45]), _batch(records[45:], seq=1)]
        counted = segment_records(rng, 40, segments=("tools", "default"), shadow_rate=0.0)
        aggregator = Aggregator(exit_layers=LAYERS, num_layers=FULL)
        for record in counted:
            aggregator.add(TokenRecord.model_validate(record))
        aggregate = AggregateBatch(batch_id=uuid.uuid4().hex, deployment="mix",
                                   runtime_id="rt-2", seq=0, num_layers=FULL,
                                   raw_sample_rate=0.0, cells=aggregator.cut())
        for batch in batches:
            assert client.post("/v1/telemetry", json=batch, headers=runtime).json()["queued"]
        assert client.post("/v1/telemetry", headers={
            **runtime, "Content-Type": AGGREGATE_MSGPACK},
            content=msgpack.packb(aggregate.model_dump(mode="json"))).json()["queued"]
        with Session(engine) as session:  # checked by the API, not yet admitted
            deployment = get_deployment(session=session, name="mix")
            assert known_segments(session=session, deployment_id=deployment.id) == ["code"]
        factory = sessionmaker(bind=engine, expire_on_commit=False)
        worker = stream.StreamIngestor(redis_client, factory, name="seg-worker", count=10,
                                       block_ms=10)
        while worker.run_once():
            pass
        # A reclaimed entry that was already committed: stored again, it adds nothing.
        with factory() as session:
            deployment = get_deployment(session=session, name="mix")
            [result] = service.ingest(session=session, deployment=deployment,
                                      batches=[TelemetryBatch.model_validate(batches[0])])
            session.commit()
            assert result.duplicate
            assert known_segments(session=session, deployment_id=deployment.id) == [
                "chat", "code", "tools"]
    app.state.config_delivery.close()

    everything = records + counted
    rollups = _rollups(engine)
    for key, (reached, exits) in expected_exits(everything).items():
        assert rollups[key][:2] == (reached, exits), key
    assert sum(rollups[(segment, LAYERS[0])][0] for segment in ("default", "chat", "code",
                                                                "tools")) == len(everything)
    assert _stored_segments(engine, TokenRecordRow) == Counter(map(segment_of, records))


@pytest.mark.postgres
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_concurrent_writers_with_new_names_keep_the_cap_exact(engine, client, tokens):
    """Writers that meet new names at once: none deadlocks, the registry stops at the cap, and
    every name's traffic is stored as itself exactly when it was registered."""
    import threading

    deploy_with_segments(client, tokens, engine, declare=(), auto=True)  # declares `code`
    with Session(engine) as session:
        deployment_id = get_deployment(session=session, name="mix").id
        admit_segments(session=session, deployment_id=deployment_id, auto=True,
                       names=[f"s{index:02d}" for index in range(12)])  # 13 of 16 taken
        session.commit()
    names = {writer: (f"w{writer}a", f"w{writer}b", "code") for writer in range(4)}
    payloads = [_batch(segment_records(random.Random(writer), 30, segments=names[writer]),
                       runtime_id=f"rt-{writer}") for writer in names]
    start, errors = threading.Barrier(len(payloads)), []

    def write(payload: dict) -> None:
        try:
            batch = TelemetryBatch.model_validate(payload)
            with Session(engine) as session:
                start.wait()
                service.ingest(session=session, deployment=get_deployment(
                    session=session, name="mix"), batches=[batch])
                session.commit()
        except Exception as error:  # reported below: a deadlock would land here
            errors.append(error)

    threads = [threading.Thread(target=write, args=(payload,)) for payload in payloads]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    with Session(engine) as session:
        known = known_segments(session=session, deployment_id=deployment_id)
    assert len(known) == 16
    new = {name for writer in names for name in names[writer][:2]}
    assert len(new & set(known)) == 3
    sent = Counter(segment_of(record) for payload in payloads for record in payload["records"])
    expected = Counter()
    for name, count in sent.items():
        expected[name if name in known or name == "default" else "default"] += count
    assert _stored_segments(engine, TokenRecordRow) == expected
    rollups = _rollups(engine)
    assert {segment: tokens for (segment, layer), (tokens, *_) in rollups.items()
            if layer == LAYERS[0]} == expected


@pytest.mark.redis
def test_the_ingest_worker_counts_tokens_past_the_cap(settings, engine, tokens, own_redis):
    from fastapi.testclient import TestClient

    from exitplane.app import create_app

    url, redis_client = own_redis
    app = create_app(settings.model_copy(update={"redis_url": url}), engine=engine)
    with TestClient(app) as client:
        runtime = deploy_with_segments(client, tokens, engine, declare=(), auto=True)
        _fill_the_cap(engine)
        records = segment_records(random.Random(10), 40,
                                  segments=("late", "code", "default", "late"))
        counted = segment_records(random.Random(11), 30, segments=("later", "s01"), shadow_rate=0.0)
        batch, aggregate = _batch(records), _aggregate_of(counted, seq=0, runtime_id="rt-2")
        before = _overflow_counted()
        assert client.post("/v1/telemetry", json=batch, headers=runtime).json()["queued"]
        assert client.post("/v1/telemetry", headers={
            **runtime, "Content-Type": AGGREGATE_MSGPACK},
            content=msgpack.packb(aggregate.model_dump(mode="json"))).json()["queued"]
        assert _overflow_counted() == before  # queued: nothing is stored, nothing relabelled
        worker = stream.StreamIngestor(redis_client, sessionmaker(bind=engine), name="cap-worker",
                                       count=10, block_ms=10)
        while worker.run_once():
            pass
    app.state.config_delivery.close()
    assert _overflow_counted() - before == 20 + 15
    assert _stored_segments(engine, TokenRecordRow) == {"default": 30, "code": 10}
