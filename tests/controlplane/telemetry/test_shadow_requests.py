"""Shadow requests through ingestion: assembled once whole whatever the order their tokens
arrive in, stored once under replays, dropped when inconsistent, bounded in length and in how
long an incomplete one waits, and read back under the trust rules."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
from sqlalchemy import func, select

from controlplane.settings import get_settings
from controlplane.telemetry import shadow_requests
from controlplane.telemetry.models import ShadowRequestRow, ShadowRequestTokenRow, ShadowSampleRow
from controlplane.telemetry.service import ingest, purge
from exitplane.wire import TelemetryBatch
from tests.support.batches import telemetry_batch
from tests.support.calibration import FULL, LAYERS, make_deployment
from tests.support.shadow_requests import shadow_request_records


def _labels(seed: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    signals = rng.random((tokens, len(LAYERS))).astype(np.float32)
    return signals, rng.random(signals.shape) < 0.8


def _send(session, deployment, records, *, runtime_id="rt-1", batch_id=None, **fields):
    batch = TelemetryBatch.model_validate(telemetry_batch(
        records, runtime_id=runtime_id, num_layers=FULL, batch_id=batch_id, **fields))
    result = ingest(session=session, deployment=deployment, batches=[batch])
    session.flush()
    return batch, result


def _count(session, model) -> int:
    return session.scalar(select(func.count()).select_from(model))


def _read(session, deployment, **options):
    return shadow_requests.shadow_request_evidence(
        session=session, deployment_id=deployment.id, width=len(LAYERS),
        since=datetime.now(UTC) - timedelta(hours=1), **options)


def test_a_request_split_across_batches_is_assembled_once_whole(session):
    deployment = make_deployment(session)
    signals, matched = _labels(1, 7)
    start = datetime.now(UTC).timestamp() - 60
    records = shadow_request_records(signals, matched, request_id="q-1", start=start)
    _send(session, deployment, records[4:])  # the end arrives first
    assert _count(session, ShadowRequestRow) == 0
    assert _count(session, ShadowRequestTokenRow) == 3
    first, _ = _send(session, deployment, records[:4])
    assert _count(session, ShadowRequestTokenRow) == 0
    found = _read(session, deployment)
    assert found.requests == ["q-1"] and found.runtimes == ["rt-1"]
    assert found.offsets.tolist() == [0, 7]
    np.testing.assert_array_equal(found.signals, signals)
    np.testing.assert_array_equal(found.matched, matched)
    # its tokens are shadow tokens as well: the token evidence keeps them
    assert _count(session, ShadowSampleRow) == 7
    # a replayed batch is skipped; a token sent again after completion changes nothing
    _, replay = _send(session, deployment, records[:4], batch_id=first.batch_id)
    assert replay[0].duplicate
    _send(session, deployment, records[2:3])
    assert _count(session, ShadowRequestRow) == 1
    assert _count(session, ShadowRequestTokenRow) == 0


def test_an_incomplete_request_waits_and_then_expires(session):
    deployment = make_deployment(session)
    signals, matched = _labels(2, 5)
    records = shadow_request_records(signals, matched, request_id="q-2",
                                     start=datetime.now(UTC).timestamp() - 60)
    _send(session, deployment, records[:2] + records[3:])  # position 2 never arrives
    assert _count(session, ShadowRequestRow) == 0
    assert _count(session, ShadowRequestTokenRow) == 4
    ttl = get_settings().shadow_request_ttl_s
    assert shadow_requests.expire(session=session, deployment_id=deployment.id,
                                  now=datetime.now(UTC) + timedelta(seconds=ttl)) == 4
    assert _count(session, ShadowRequestTokenRow) == 0


def test_a_request_whose_tokens_disagree_on_segment_is_dropped(session):
    deployment = make_deployment(session, auto_segments=True)
    signals, matched = _labels(3, 4)
    start = datetime.now(UTC).timestamp() - 60
    records = shadow_request_records(signals, matched, request_id="q-3", start=start)
    _send(session, deployment, records[:2])
    moved = shadow_request_records(signals, matched, request_id="q-3", start=start,
                                   segment="code")
    _send(session, deployment, moved[2:])
    assert _count(session, ShadowRequestRow) == 0
    # its tokens are dropped; only the mark that it is inconsistent stays, so that the rest
    # of the request arriving again never completes it
    assert session.scalars(select(ShadowRequestTokenRow.position)).all() == [-1]
    _send(session, deployment, records)
    assert _count(session, ShadowRequestRow) == 0


def test_a_request_longer_than_the_cap_is_not_kept(session, monkeypatch):
    monkeypatch.setenv("EXITPLANE_SHADOW_REQUEST_MAX_TOKENS", "3")
    get_settings.cache_clear()
    try:
        deployment = make_deployment(session)
        signals, matched = _labels(4, 5)
        _send(session, deployment, shadow_request_records(
            signals, matched, request_id="long", start=datetime.now(UTC).timestamp() - 60))
        short_signals, short_matched = _labels(5, 3)
        _send(session, deployment, shadow_request_records(
            short_signals, short_matched, request_id="short",
            start=datetime.now(UTC).timestamp() - 30))
        assert _count(session, ShadowRequestTokenRow) == 3  # the long one's first three
        assert _read(session, deployment).requests == ["short"]
    finally:
        get_settings.cache_clear()


def test_reads_filter_by_segment_and_version_and_leave_out_excluded_runtimes(session):
    deployment = make_deployment(session, auto_segments=True)
    start = datetime.now(UTC).timestamp() - 120
    for index, (runtime_id, segment) in enumerate([("rt-1", None), ("rt-2", "code"),
                                                   ("rt-3", None)]):
        signals, matched = _labels(10 + index, 3)
        _send(session, deployment, shadow_request_records(
            signals, matched, request_id=f"q-{index}", start=start + index,
            segment=segment), runtime_id=runtime_id)
    assert _read(session, deployment).requests == ["q-0", "q-1", "q-2"]
    assert _read(session, deployment, segment="code").requests == ["q-1"]
    assert _read(session, deployment, version=2).requests == []
    assert _read(session, deployment, exclude={"rt-3"}).requests == ["q-0", "q-1"]
    found = _read(session, deployment, exclude_witnesses={"runtime:rt-1"})
    assert found.requests == ["q-1", "q-2"]
    assert found.take(np.array([False, True])).requests == ["q-2"]


@pytest.mark.parametrize("aggregated", [False, True])
def test_a_sampled_batch_keeps_shadow_requests(session, aggregated):
    deployment = make_deployment(session)
    signals, matched = _labels(6, 3)
    _send(session, deployment, shadow_request_records(
        signals, matched, request_id="q-6", start=datetime.now(UTC).timestamp() - 60),
        aggregated=aggregated)
    assert _read(session, deployment).requests == ["q-6"]


def test_retention_sweeps_completes_what_waits_and_drops_what_is_old(session):
    """The retention pass assembles a request whose end arrived but was not assembled (its
    last tokens came in a transaction that did not see the others), drops staged tokens past
    their time to live and removes requests older than the retention."""
    deployment = make_deployment(session)
    signals, matched = _labels(7, 4)
    now = datetime.now(UTC)
    records = shadow_request_records(signals, matched, request_id="q-7",
                                     start=now.timestamp() - 60)
    _send(session, deployment, records[:3])
    session.add(ShadowRequestTokenRow(
        deployment_id=deployment.id, runtime_id="rt-1", request_id="q-7", position=3,
        ts=now, threshold_version=0, segment="default", witness="runtime:rt-1",
        model_revision="", head_digest="", arrival_delay_s=0.0, request_end=True,
        signals=signals[3].astype("<f4").tobytes(), matched=matched[3].astype(np.uint8).tobytes()))
    old = shadow_request_records(signals, matched, request_id="q-old",
                                 start=now.timestamp() - 10 * 86400)
    _send(session, deployment, old)
    stale = shadow_request_records(signals, matched, request_id="q-stale", end=False,
                                   start=now.timestamp() - 2 * get_settings().shadow_request_ttl_s)
    _send(session, deployment, stale)
    session.flush()
    deleted = purge(session=session, older_than=now - timedelta(days=3))
    assert deleted["shadow_requests"] == 1  # q-old
    assert deleted["shadow_request_tokens"] == 4  # q-stale's
    found = _read(session, deployment)
    assert found.requests == ["q-7"]
    np.testing.assert_array_equal(found.signals, signals)
    assert _count(session, ShadowRequestTokenRow) == 0
