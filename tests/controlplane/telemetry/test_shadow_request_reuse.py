"""Shadow-request ids used twice: a position that arrives again with other content (a second
request under a cancelled one's id, or two in one batch) makes the request inconsistent, so it
never completes; an identical replay of a position changes nothing."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
from sqlalchemy import func, select

from controlplane.telemetry import shadow_requests
from controlplane.telemetry.models import ShadowRequestRow, ShadowRequestTokenRow
from controlplane.telemetry.service import ingest
from exitplane.wire import TelemetryBatch
from tests.support.batches import telemetry_batch
from tests.support.calibration import FULL, LAYERS, make_deployment
from tests.support.shadow_requests import shadow_request_records


def _labels(seed: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    signals = rng.random((tokens, len(LAYERS))).astype(np.float32)
    return signals, rng.random(signals.shape) < 0.8


def _send(session, deployment, records, *, runtime_id="rt-1") -> None:
    batch = TelemetryBatch.model_validate(telemetry_batch(records, runtime_id=runtime_id,
                                                          num_layers=FULL))
    ingest(session=session, deployment=deployment, batches=[batch])
    session.flush()


def _requests(session, deployment) -> list[str]:
    return shadow_requests.shadow_request_evidence(
        session=session, deployment_id=deployment.id, width=len(LAYERS),
        since=datetime.now(UTC) - timedelta(hours=1)).requests


def _staged(session) -> int:
    return session.scalar(select(func.count()).select_from(ShadowRequestTokenRow)
                          .where(ShadowRequestTokenRow.position >= 0))


def test_a_new_request_under_a_cancelled_ones_staged_id_never_completes(session):
    deployment = make_deployment(session)
    start = datetime.now(UTC).timestamp() - 60
    cancelled = shadow_request_records(*_labels(1, 3), request_id="req-0", start=start,
                                       end=False)
    _send(session, deployment, cancelled)
    assert _staged(session) == 3
    # the runtime restarted and served another request under the same id: its first three
    # positions clash with the cancelled one's, its end would complete a mixture
    _send(session, deployment, shadow_request_records(*_labels(2, 6), request_id="req-0",
                                                      start=start + 30))
    assert _requests(session, deployment) == []
    assert _staged(session) == 0
    # its positions arriving once more do not bring it back
    _send(session, deployment, shadow_request_records(*_labels(2, 6), request_id="req-0",
                                                      start=start + 30))
    assert _requests(session, deployment) == [] and _staged(session) == 0


def test_one_batch_with_a_position_twice_under_other_content_never_completes(session):
    deployment = make_deployment(session)
    start = datetime.now(UTC).timestamp() - 60
    first = shadow_request_records(*_labels(3, 4), request_id="q-1", start=start)
    second = shadow_request_records(*_labels(4, 4), request_id="q-1", start=start)
    _send(session, deployment, first[:2] + second)
    assert _requests(session, deployment) == [] and _staged(session) == 0


def test_a_different_end_marker_at_a_staged_position_is_a_clash(session):
    deployment = make_deployment(session)
    start = datetime.now(UTC).timestamp() - 60
    records = shadow_request_records(*_labels(5, 4), request_id="q-2", start=start)
    _send(session, deployment, records[:3])
    ended_early = [dict(record) for record in records[:3]]
    ended_early[2]["request_end"] = True
    _send(session, deployment, ended_early[2:])
    _send(session, deployment, records[3:])
    assert _requests(session, deployment) == []


def test_an_identical_replay_of_staged_positions_changes_nothing(session):
    deployment = make_deployment(session)
    signals, matched = _labels(6, 5)
    records = shadow_request_records(signals, matched, request_id="q-3",
                                     start=datetime.now(UTC).timestamp() - 60)
    _send(session, deployment, records[:3])
    _send(session, deployment, records[1:3] + records[1:2])  # another batch, same tokens
    assert _staged(session) == 3
    _send(session, deployment, records[2:])
    assert _requests(session, deployment) == ["q-3"]
    assert session.scalar(select(ShadowRequestRow.tokens)) == 5
    assert _staged(session) == 0
