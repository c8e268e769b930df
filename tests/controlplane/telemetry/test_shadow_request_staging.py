"""Staging reads back a request's tokens only once its staged counts say it can be complete
(or is inconsistent): a batch without an end marker, or one that only repeats staged tokens,
loads no staged request whole, whatever the order the tokens arrive in."""

from __future__ import annotations

from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

import numpy as np
from sqlalchemy import event

from controlplane.telemetry import shadow_requests
from controlplane.telemetry.models import ShadowRequestTokenRow
from controlplane.telemetry.service import ingest
from exitplane.wire import TelemetryBatch
from tests.support.batches import telemetry_batch
from tests.support.calibration import FULL, LAYERS, make_deployment
from tests.support.shadow_requests import shadow_request_records


@contextmanager
def _loaded_tokens():
    """Counts the staged tokens loaded as rows while the block runs."""
    loaded = []

    def count(target, context) -> None:
        loaded.append(target.position)

    event.listen(ShadowRequestTokenRow, "load", count)
    try:
        yield loaded
    finally:
        event.remove(ShadowRequestTokenRow, "load", count)


def _send(session, deployment, records) -> None:
    batch = TelemetryBatch.model_validate(telemetry_batch(records, num_layers=FULL))
    ingest(session=session, deployment=deployment, batches=[batch])
    session.flush()
    session.expunge_all()  # rows a later statement returns are loaded afresh


def _request(seed: int, request_id: str, tokens: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    signals = rng.random((tokens, len(LAYERS))).astype(np.float32)
    return shadow_request_records(signals, rng.random(signals.shape) < 0.8,
                                  request_id=request_id,
                                  start=datetime.now(UTC).timestamp() - 120)


def _requests(session, deployment) -> list[str]:
    return shadow_requests.shadow_request_evidence(
        session=session, deployment_id=deployment.id, width=len(LAYERS),
        since=datetime.now(UTC) - timedelta(hours=1)).requests


def test_a_batch_without_an_end_loads_no_staged_request(session):
    deployment = make_deployment(session)
    requests = [_request(index, f"q-{index}", 60) for index in range(10)]
    _send(session, deployment, [record for records in requests for record in records[:50]])
    with _loaded_tokens() as loaded:
        _send(session, deployment, [records[50] for records in requests])
    assert loaded == []
    with _loaded_tokens() as loaded:  # a repeat reads back only the positions it repeats
        _send(session, deployment, [records[50] for records in requests])
    assert len(loaded) == 10
    with _loaded_tokens() as loaded:
        _send(session, deployment, [record for records in requests for record in records[51:]])
    assert len(loaded) == 10 * 60
    assert sorted(_requests(session, deployment)) == sorted(f"q-{i}" for i in range(10))


def test_a_request_completes_when_its_end_comes_first_and_gaps_fill_later(session):
    deployment = make_deployment(session)
    records = _request(20, "q-gaps", 10)
    with _loaded_tokens() as loaded:
        _send(session, deployment, records[9:])  # the end first
        _send(session, deployment, records[:3] + records[6:9])
        _send(session, deployment, records[4:6])
    assert loaded == [] and _requests(session, deployment) == []
    with _loaded_tokens() as loaded:
        _send(session, deployment, records[3:4])  # the last gap
    assert sorted(loaded) == list(range(10))
    assert _requests(session, deployment) == ["q-gaps"]


def test_the_sweep_completes_what_staging_left(session):
    deployment = make_deployment(session)
    records = _request(30, "q-swept", 4)
    _send(session, deployment, records[:3])
    staged = dict(records[3])
    session.add(ShadowRequestTokenRow(
        deployment_id=deployment.id, runtime_id="rt-1", request_id="q-swept", position=3,
        ts=datetime.fromtimestamp(staged["ts"], UTC), threshold_version=0, segment="default",
        witness="runtime:rt-1", model_revision="", head_digest="", arrival_delay_s=0.0,
        request_end=True,
        signals=np.array([p["signal"] for p in staged["shadow"]], "<f4").tobytes(),
        matched=np.array([p["matched"] for p in staged["shadow"]], np.uint8).tobytes()))
    session.flush()
    assert shadow_requests.assemble_all(session=session) == 1
    assert _requests(session, deployment) == ["q-swept"]
