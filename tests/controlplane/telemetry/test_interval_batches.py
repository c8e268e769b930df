"""Interval batches: an aggregating runtime's counts and records in one request.
The control plane stores one exactly as the aggregate batch and the `aggregated` record batch
it stands for (same rollups, rows and shadow samples), once per batch id, over HTTP and
through the Redis stream; a bad one is refused whole, naming what is wrong."""

import random
import uuid

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from controlplane.deployments.service import get_deployment
from controlplane.telemetry import stream
from controlplane.telemetry.models import Rollup, RollupHistogram, ShadowSampleRow, TokenRecordRow
from exitplane.client.aggregate import Aggregator
from exitplane.wire import (
    AGGREGATE_MSGPACK,
    INTERVAL_JSON,
    INTERVAL_MSGPACK,
    RECORDS_MSGPACK,
    IntervalBatch,
    RecordColumns,
    TokenRecord,
)
from tests.support.batches import expected_exits, post_telemetry, segment_records
from tests.support.deployments import FULL, LAYERS, deploy_with_segments
from tests.support.services import REDIS_URL
from tests.support.waiting import patient_get


def _traffic(seed: int = 3, count: int = 150):
    """A runtime's interval: every token (three segments, 30% shadow) and what it ships of
    them as records (every shadow token and every fourth of the others)."""
    records = segment_records(random.Random(seed), count)
    carried = [record for index, record in enumerate(records)
               if record.get("shadow") or index % 4 == 0]
    aggregator = Aggregator(exit_layers=LAYERS, num_layers=FULL)
    for record in records:
        assert aggregator.add(TokenRecord.model_validate(record))
    return records, carried, aggregator.cut()


def _interval(deployment: str, cells, carried: list[dict], **fields) -> dict:
    columns = RecordColumns.of([TokenRecord.model_validate(r) for r in carried]) if carried \
        else None
    return IntervalBatch(batch_id=uuid.uuid4().hex, deployment=deployment,
                         runtime_id="rt-1", seq=0, num_layers=FULL, raw_sample_rate=0.25,
                         cells=cells, records=columns, **fields).model_dump(mode="json")


def _stored(engine, name: str) -> dict:
    """What the store holds of deployment `name`: rollups and histograms per key, rows."""
    with Session(engine) as session:
        deployment_id = get_deployment(session=session, name=name).id
        rollups = session.execute(
            select(Rollup.version, Rollup.minute, Rollup.segment, Rollup.layer, Rollup.tokens,
                   Rollup.exits, Rollup.shadow_total, Rollup.shadow_matches,
                   Rollup.policy_exits, Rollup.policy_mismatches)
            .where(Rollup.deployment_id == deployment_id)).all()
        histograms = session.execute(
            select(RollupHistogram.version, RollupHistogram.minute, RollupHistogram.segment,
                   RollupHistogram.layer, RollupHistogram.bin, RollupHistogram.count)
            .where(RollupHistogram.deployment_id == deployment_id)).all()
        rows = session.execute(
            select(TokenRecordRow.request_id, TokenRecordRow.position, TokenRecordRow.segment,
                   TokenRecordRow.exit_layer).where(TokenRecordRow.deployment_id == deployment_id)
        ).all()
        shadows = session.scalar(select(func.count()).select_from(ShadowSampleRow).where(
            ShadowSampleRow.deployment_id == deployment_id))
    return {"rollups": sorted(map(tuple, rollups)), "histograms": sorted(map(tuple, histograms)),
            "rows": sorted(map(tuple, rows)), "shadows": shadows}


def test_an_interval_batch_stores_what_its_pair_stores_once(client, tokens, engine):
    headers = deploy_with_segments(client, tokens, engine, name="mix")
    other = deploy_with_segments(client, tokens, engine, name="pair")
    records, carried, cells = _traffic()

    interval = _interval("mix", cells, carried)
    answers = [post_telemetry(client, headers, interval) for _ in range(2)]
    assert [a.status_code for a in answers] == [202, 202], answers[0].text
    assert [a.json()["duplicate"] for a in answers] == [False, True]
    assert answers[0].json()["accepted"] == len(records)  # tokens, as an aggregate batch

    # The pair it stands for, to another deployment with the same thresholds.
    pair_cells = {**interval, "deployment": "pair", "batch_id": uuid.uuid4().hex}
    del pair_cells["records"]
    assert post_telemetry(client, other, pair_cells, AGGREGATE_MSGPACK).status_code == 202
    sampled = {"batch_id": uuid.uuid4().hex, "deployment": "pair", "runtime_id": "rt-1",
               "seq": 1, "num_layers": FULL, "records": carried, "aggregated": True}
    assert post_telemetry(client, other, sampled, RECORDS_MSGPACK).status_code == 202

    mine, theirs = _stored(engine, "mix"), _stored(engine, "pair")
    assert mine == theirs
    assert len(mine["rows"]) == len(carried)
    assert mine["shadows"] == sum(1 for r in carried if r.get("shadow")) > 0
    reached = {}
    for row in mine["rollups"]:
        reached[(row[2], row[3])] = reached.get((row[2], row[3]), (0, 0))
        reached[(row[2], row[3])] = (reached[(row[2], row[3])][0] + row[4],
                                     reached[(row[2], row[3])][1] + row[5])
    assert reached == {key: value for key, value in expected_exits(records).items() if value[0]}
    # shadow labels once, from the records: every shadow token at the first exit layer
    assert sum(row[6] for row in mine["rollups"] if row[3] == LAYERS[0]) == mine["shadows"]
    counts = patient_get(client, "/v1/deployments/mix/telemetry/count", headers=headers).json()
    assert counts["records_sampled"] and counts["raw_sample_rate"] == 0.25
    assert counts["tokens"] == len(records) and counts["records"] == len(carried)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_records_alone_or_counts_alone_and_json(client, tokens, engine):
    headers = deploy_with_segments(client, tokens, engine, name="mix")
    records, carried, cells = _traffic(seed=5, count=60)
    assert post_telemetry(client, headers, _interval("mix", [], carried), INTERVAL_JSON).json()[
        "accepted"] == 0
    assert post_telemetry(client, headers,
                          _interval("mix", cells, [])).json()["accepted"] == len(records)
    stored = _stored(engine, "mix")
    assert len(stored["rows"]) == len(carried)
    assert sum(row[4] for row in stored["rollups"] if row[3] == LAYERS[0]) == len(records)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_bad_interval_batch_is_refused_whole(client, tokens, engine):
    headers = deploy_with_segments(client, tokens, engine, name="mix")
    _, carried, cells = _traffic(seed=9, count=40)
    good = _interval("mix", cells, carried)
    columns = good["records"]
    shadowed = columns["shadow_record"][0]

    def refused(payload: dict, needle: str) -> None:
        answer = post_telemetry(client, headers, {**payload, "batch_id": uuid.uuid4().hex})
        assert answer.status_code == 422, answer.text
        assert needle in answer.json()["detail"], answer.json()

    refused({**good, "records": {**columns, "ts": columns["ts"][1:]}}, "column ts has")
    refused({**good, "records": {**columns, "exit_layer": [5, *columns["exit_layer"][1:]]}},
            "record 0: exit_layer 5 is neither an exit layer")
    refused({**good, "records": {**columns, "exit_layer": [13, *columns["exit_layer"][1:]]}},
            "exit_layer 13 exceeds num_layers 12")
    refused({**good, "records": {**columns, "threshold_version": [
        9, *columns["threshold_version"][1:]]}}, "threshold_version 9 was never published")
    refused({**good, "records": {**columns, "shadow_layer": [
        4, *columns["shadow_layer"][1:]]}}, f"record {shadowed}: shadow points must cover")
    refused({**good, "records": {**columns, "shadow_layer": [
        columns["shadow_layer"][1], *columns["shadow_layer"][1:]]}},
        "shadow points repeat an exit layer")
    refused({**good, "records": {**columns, "signal_value": [
        1.5, *columns["signal_value"][1:]]}}, "records.signal_value.0")
    refused({key: value for key, value in good.items() if key not in ("cells", "records")},
            "carries cells, records or both")
    # the id a pull or heartbeat would refuse (and the fleet view would show) is refused here
    refused({**good, "runtime_id": "pod/3\nFAKE log line"}, "runtime_id")
    refused({**good, "cells": [{**good["cells"][0], "layer": 5}, *good["cells"][1:]]},
            "cell 0: layer 5 is neither")
    assert _stored(engine, "mix") == {"rollups": [], "histograms": [], "rows": [], "shadows": 0}

    future = client.post("/v1/telemetry", content=b"{}", headers={
        **headers, "Content-Type": "application/vnd.exitplane.sketch+msgpack"})
    assert future.status_code == 415 and INTERVAL_MSGPACK in future.json()["detail"]


@pytest.fixture
def own_redis():
    import redis

    if not REDIS_URL:
        raise RuntimeError("set EXITPLANE_TEST_REDIS_URL (make test starts Redis)")
    url = REDIS_URL.rsplit("/", 1)[0] + "/11"
    client = redis.Redis.from_url(url)

    def clean() -> None:
        client.delete(stream.STREAMS_KEY, stream.stream_key("mix"), stream.DEAD_LETTER,
                      *client.scan_iter(match=stream.SEEN_PREFIX + "*"))

    clean()
    yield url, client
    clean()


@pytest.mark.redis
def test_the_stream_path_stores_an_interval_batch_once(settings, engine, tokens, own_redis):
    from fastapi.testclient import TestClient

    from exitplane.app import create_app

    url, redis_client = own_redis
    app = create_app(settings.model_copy(update={"redis_url": url}), engine=engine)
    try:
        with TestClient(app) as client:
            headers = deploy_with_segments(client, tokens, engine, name="mix")
            records, carried, cells = _traffic(seed=11)
            interval = _interval("mix", cells, carried)
            answers = [post_telemetry(client, headers, interval) for _ in range(2)]
            assert [a.json()["queued"] for a in answers] == [True, True]
            assert [a.json()["duplicate"] for a in answers] == [False, True]
            [(_, [(_, fields)])] = redis_client.xread({stream.stream_key("mix"): "0"})
            # its own field (an older worker dead-letters it) and the witness that posted it
            assert list(fields) == [b"interval", b"witness"]
            assert fields[b"witness"].startswith(b"token:")
            worker = stream.StreamIngestor(redis_client, sessionmaker(bind=engine),
                                           name="interval-worker", count=10, block_ms=10)
            while worker.run_once():
                pass
            assert worker.stats.batches == 1 and worker.stats.dead == 0
    finally:
        app.state.config_delivery.close()
    stored = _stored(engine, "mix")
    assert len(stored["rows"]) == len(carried)
    assert sum(row[4] for row in stored["rollups"] if row[3] == LAYERS[0]) == len(records)
    assert sum(row[6] for row in stored["rollups"] if row[3] == LAYERS[0]) == \
        stored["shadows"] > 0
