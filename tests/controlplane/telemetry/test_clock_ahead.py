"""A runtime whose clock runs ahead is told so (fleets of many kinds).

Tokens timed hours ahead would be stored where no drift window, gauge or canary looks (and in
PostgreSQL's default partition); the API refuses such a batch with a 422 that names the token
and says to check the runtime's clock. Late timestamps are fine: spooled batches arrive late."""

import random
import time

import pytest
from fastapi.testclient import TestClient

from controlplane.telemetry.models import HISTOGRAM_BINS
from exitplane.app import create_app
from exitplane.wire import AGGREGATE_MSGPACK, INTERVAL_MSGPACK
from tests.support.batches import aggregate_batch, post_telemetry, segment_records, telemetry_batch
from tests.support.deployments import LAYERS, deploy_with_segments
from tests.support.waiting import patient_get


def _batch(records: list[dict]) -> dict:
    return telemetry_batch(records, deployment="mix")


def _cells(minute: int) -> list[dict]:
    return [{"minute": minute, "threshold_version": 2, "layer": LAYERS[0], "exits": 3,
             "histogram": [0] * HISTOGRAM_BINS}]


def _aggregate(minute: int, **fields) -> dict:
    return aggregate_batch(_cells(minute), deployment="mix", **fields)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_tokens_timed_past_the_apis_clock_are_refused_and_late_ones_taken(client, tokens,
                                                                          engine):
    headers = deploy_with_segments(client, tokens, engine)
    now = time.time()
    minute = int(now) // 60 * 60

    def post(payload: dict, content_type: str | None = None):
        if content_type is None:
            return client.post("/v1/telemetry", headers=headers, json=payload)
        return post_telemetry(client, headers, payload, content_type)

    records = segment_records(random.Random(4), 5, ts=now)
    records[3]["ts"] = now + 3600  # one token an hour ahead
    ahead = post(_batch(records))
    assert ahead.status_code == 422, ahead.text
    assert ahead.json()["index"] == 3
    assert "check the runtime's clock" in ahead.json()["detail"]
    cell = post(_aggregate(minute + 3600), AGGREGATE_MSGPACK)
    assert cell.status_code == 422 and cell.json()["detail"].startswith("cell 0: minute")
    carried = post(_aggregate(minute, records={
        "threshold_version": [2], "request_id": ["r"], "position": [0],
        "exit_layer": [LAYERS[0]], "signal_value": [0.9], "latency_us": [5],
        "ts": [now + 7200]}), INTERVAL_MSGPACK)
    assert carried.status_code == 422 and "check the runtime's clock" in carried.text

    # A few minutes of skew, and timestamps days late (a spool replayed), are taken.
    assert post(_batch(segment_records(random.Random(5), 5, ts=now + 240))).status_code == 202
    assert post(_batch(segment_records(random.Random(6), 5, ts=now - 3 * 86400))).status_code == 202
    assert post(_aggregate(minute + 300), AGGREGATE_MSGPACK).status_code == 202
    counts = patient_get(client, "/v1/deployments/mix/telemetry/count", headers=headers).json()
    assert counts["records"] == 10 and counts["tokens"] == 13


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_clock_check_can_be_turned_off(settings, engine, tokens):
    app = create_app(settings.model_copy(update={"telemetry_max_future_s": 0}), engine=engine)
    with TestClient(app) as client:
        headers = deploy_with_segments(client, tokens, engine)
        answer = client.post("/v1/telemetry", headers=headers, json=_batch(
            segment_records(random.Random(7), 3, ts=time.time() + 86400)))
        assert answer.status_code == 202, answer.text
    app.state.config_delivery.close()
