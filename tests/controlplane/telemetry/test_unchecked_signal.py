"""Tokens whose exits were not checked (signal None on the wire): stored as NULL,
counted in the exit-rate rollups, left out of the signal histogram; shadow samples keep their
request id."""

from __future__ import annotations

import time

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.deployments.schemas import DeploymentCreate
from controlplane.deployments.service import create_deployment
from controlplane.telemetry import service
from controlplane.telemetry.columns import parse_batch
from controlplane.telemetry.models import Rollup, ShadowSampleRow, TokenRecordRow
from exitplane.wire import TelemetryBatch
from tests.support.batches import telemetry_batch
from tests.support.deployments import FULL, LAYERS


def _batch(n: int = 40) -> dict:
    now = time.time()
    records = []
    for i in range(n):
        record = {"threshold_version": 0, "request_id": f"req-{i // 10}", "position": i % 10,
                  "exit_layer": FULL, "signal_value": None, "latency_us": 900,
                  "ts": now + i * 0.01}
        if i % 4 == 0:  # shadow tokens are checked at every exit layer: they have a signal
            record["signal_value"] = 0.42
            record["shadow"] = [{"layer": k, "signal": 0.42, "matched": True} for k in LAYERS]
        records.append(record)
    return telemetry_batch(records)


def test_columns_carry_none_both_ways():
    payload = _batch()
    columns = parse_batch(payload)
    assert columns.to_wire() == TelemetryBatch.model_validate(payload).model_dump(mode="json")
    assert sum(r["signal_value"] is None for r in columns.to_wire()["records"]) == 30
    assert int(columns.signal_value.size) == 40  # NaN stands for None in the column


def test_unchecked_tokens_stored_null_counted_but_not_in_the_histogram(session: Session):
    deployment = create_deployment(session=session, actor="test", spec=DeploymentCreate(
        name="chat", model_ref="tiny", num_layers=FULL, exit_layers=LAYERS))
    payload = _batch()
    service.ingest(session=session, deployment=deployment,
                   batches=[TelemetryBatch.model_validate(payload)])
    stored = session.scalars(select(TokenRecordRow.signal_value)
                             .order_by(TokenRecordRow.idx)).all()
    assert stored == [0.42 if i % 4 == 0 else None for i in range(40)]
    reached: dict[int, int] = {}
    for row in session.scalars(select(Rollup)):  # the batch's 0.4 s may straddle a minute
        reached[row.layer] = reached.get(row.layer, 0) + row.tokens
    assert reached[LAYERS[0]] == 40  # every token reached every layer (none could exit)
    since = min(session.scalars(select(Rollup.minute)))
    histogram = service.signal_histogram(session=session, deployment=deployment, since=since)
    assert list(histogram) == [FULL]
    assert sum(histogram[FULL]) == 10 and histogram[FULL][8] == 10  # only the shadow tokens
    requests = session.scalars(select(ShadowSampleRow.request_id)
                               .order_by(ShadowSampleRow.idx)).all()
    assert requests == ["req-0", "req-0", "req-0", "req-1", "req-1", "req-2", "req-2",
                        "req-2", "req-3", "req-3"]
    found, _, _ = service.shadow_samples_by_request(session=session, deployment=deployment,
                                                    since=since)
    assert found == requests
