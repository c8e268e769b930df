"""Recalibration per traffic segment: a segment's job reads that segment's shadow
tokens only and replaces that segment's map only; a whole-deployment job over segmented
traffic calibrates each segment (`calibrate_segments`) and keeps what each got, and why, in the
job's summary under "segments"."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
from sqlalchemy.orm import Session

from controlplane.calibration import service
from controlplane.calibration.learn_then_test import calibrate_thresholds
from controlplane.calibration.models import CalibrationJob
from controlplane.calibration.segments import recalibration_level
from controlplane.db import session_scope, utcnow
from controlplane.deployments.segments import declare_segment
from controlplane.deployments.service import (
    aliases_of,
    get_deployment,
    get_threshold_set,
    move_alias,
    publish,
)
from controlplane.errors import Invalid
from controlplane.flows import recalibration
from tests.support.calibration import LAYERS, make_deployment, separable_samples, write_traffic

POLICY = service.CalibrationPolicy(min_samples_per_layer=500, seed=0)
DEFAULT_MAP = {3: 0.95, 6: 0.9, 9: 0.85}
CHAT_MAP = {3: 0.97, 6: 0.93, 9: 0.9}
NEVER = {3: 1.0, 6: 1.0, 9: 1.0}


def _traffic(session: Session, segments: dict[str, tuple[int, float]], *, start, version=0):
    """Each segment's separable shadow tokens (count, boundary above which a layer matches
    full depth) from a runtime of its own, each record carrying its segment."""
    for seed, (segment, (count, boundary)) in enumerate(sorted(segments.items())):
        signals, matched = separable_samples(count, seed=seed + 1, mismatch_below=boundary)
        write_traffic(session, "assist", signals, matched, start=start, version=version,
                      runtime_id=f"rt-{segment}", segment=segment)


def _run(engine, *, since, segment=None) -> int:
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="assist")
        job, created = service.request_calibration(
            session=session, deployment=deployment, actor="test", since=since, policy=POLICY,
            segment=segment)
        assert created
        job_id = job.id
    with session_scope(engine) as session:
        service.start_job(session=session, job=session.get(CalibrationJob, job_id))
    with session_scope(engine) as session:
        recalibration.run_calibration(session=session, job=session.get(CalibrationJob, job_id),
                                      policy=POLICY)
    return job_id


def test_recalibrating_code_reads_code_tokens_only_and_replaces_only_its_map(engine, outbox):
    start = utcnow() - timedelta(minutes=30)
    with session_scope(engine) as session:
        deployment = make_deployment(session, name="assist")
        # code fell back (never exit); chat and default keep their own thresholds
        version = publish(session=session, deployment=deployment, thresholds=DEFAULT_MAP,
                          segments={"chat": CHAT_MAP, "code": NEVER}, reason="code fell back",
                          actor="test").version
        move_alias(session=session, deployment=deployment, alias="active", version=version,
                   actor="test", reason="code fell back")
        # code's layers match full depth above 0.5; chat's only above 0.9: calibrated on a
        # mix, code could not exit below 0.9 within δ
        _traffic(session, {"code": (4000, 0.5), "chat": (4000, 0.9)}, start=start,
                 version=version)

    job_id = _run(engine, since=start, segment="code")

    code_signals, code_matched = separable_samples(4000, seed=2, mismatch_below=0.5)
    # tested per request, with the ids write_traffic gives (64-token requests)
    alone = calibrate_thresholds(signals=code_signals, matched=code_matched,
                                 exit_layers=LAYERS, num_layers=12, delta=0.05,
                                 epsilon=recalibration_level(0.1, 3), min_samples_per_layer=500,
                                 requests=np.array([f"req-{i // 64}" for i in range(4000)]))
    with Session(engine) as session:
        job = session.get(CalibrationJob, job_id)
        assert job.status == "succeeded", job.status_reason
        assert job.segment == "code"
        assert job.summary["samples"]["total"] == 4000  # code's shadow tokens, no chat token
        # its share of ε among 'default' plus the two known segments: a (1-a)^2, a Šidák's
        a = 1 - 0.9 ** (1 / 3)
        assert job.summary["epsilon"] == pytest.approx(a * (1 - a) ** 2)
        deployment = get_deployment(session=session, name="assist")
        published = get_threshold_set(session=session, deployment=deployment,
                                      version=job.result_version)
        assert published.parent_version == version
        # code opens from never-exit on one runtime's word, with no last good version: an
        # operator approves it
        assert job.promotion == "awaiting_approval"
        recalibration.approve(session=session, deployment=deployment, job=job, actor="ops",
                              reason="checked")
        assert aliases_of(session=session, deployment=deployment)["active"] == published.version
        segments = published.segments_by_layer()
        assert segments["code"] == pytest.approx(alone.thresholds)
        assert max(segments["code"].values()) < 0.9  # code exits again, below chat's boundary
        assert segments["chat"] == CHAT_MAP
        assert published.thresholds_by_layer() == DEFAULT_MAP
        code_metrics = published.expected_metrics["segments"]["code"]
        assert code_metrics["total_exit_rate"] == pytest.approx(alone.exit_rate)
        assert "code" in published.reason


def test_a_job_for_an_unknown_segment_is_refused(session: Session, outbox):
    deployment = make_deployment(session, name="assist")
    with pytest.raises(Invalid, match="knows no traffic segment 'code'"):
        service.request_calibration(session=session, deployment=deployment, actor="test",
                                    segment="code")


def test_a_whole_deployment_job_calibrates_each_segment_and_says_what_each_got(engine, outbox):
    start = utcnow() - timedelta(minutes=30)
    with session_scope(engine) as session:
        deployment = make_deployment(session, name="assist")
        for name in ("chat", "code"):  # an operator declares them; undeclared -> 'default'
            declare_segment(session=session, deployment=deployment, name=name, actor="test")
        _traffic(session, {"chat": (4000, 0.5), "code": (4000, 0.8), "default": (300, 0.5)},
                 start=start)

    job_id = _run(engine, since=start)

    with Session(engine) as session:
        job = session.get(CalibrationJob, job_id)
        assert job.status == "succeeded", job.status_reason
        assert job.segment is None
        per_segment = job.summary["segments"]
        assert set(per_segment) == {"default", "chat", "code"}
        # chat and code run their own LTT (Šidák over 2 of 3 segments' share 2ε/3); default,
        # too small, keeps a pooled check at ε/3
        assert job.summary["segmented"]["epsilon_per_segment"] == pytest.approx(
            1 - (1 - 0.2 / 3) ** 0.5)
        assert job.summary["segmented"]["split"] == "sidak"
        assert per_segment["default"]["epsilon"] == pytest.approx(0.1 / 3)
        assert per_segment["chat"]["source"] == per_segment["code"]["source"] == "segment"
        assert per_segment["chat"]["tokens"] == per_segment["code"]["tokens"] == 4000
        assert per_segment["chat"]["holdout_passed"] is per_segment["code"]["holdout_passed"] \
            is True
        # 300 tokens are too few for default's own Learn-Then-Test: it says so
        assert per_segment["default"]["source"] in ("pooled", "conservative")
        assert "too few shadow tokens" in per_segment["default"]["reason"]
        deployment = get_deployment(session=session, name="assist")
        published = get_threshold_set(session=session, deployment=deployment,
                                      version=job.result_version)
        segments = published.segments_by_layer()
        for name in ("chat", "code"):
            assert segments[name] == pytest.approx(
                {int(k): v for k, v in per_segment[name]["thresholds"].items()})
        # code's boundary is higher: its own thresholds are stricter than chat's
        assert min(segments["code"].values()) > max(segments["chat"].values())
        assert published.thresholds_by_layer() == pytest.approx(
            {int(k): v for k, v in per_segment["default"]["thresholds"].items()})
        assert set(published.expected_metrics["segments"]) == {"chat", "code"}


def test_the_api_queues_a_segment_job_and_refuses_an_unknown_segment(client, tokens, engine,
                                                                     outbox):
    op = tokens.headers(tokens.operator)
    with session_scope(engine) as session:
        deployment = make_deployment(session, name="assist")
        publish(session=session, deployment=deployment, thresholds=DEFAULT_MAP,
                segments={"code": NEVER}, reason="code map", actor="test")
    started = client.post("/v1/deployments/assist/calibrations", headers=op,
                          json={"segment": "code", "reason": "code changed"})
    assert started.status_code == 202, started.text
    assert started.json()["job"]["segment"] == "code"
    # a whole-deployment job is another scope: it is queued beside code's
    whole = client.post("/v1/deployments/assist/calibrations", headers=op, json={})
    assert whole.status_code == 202 and whole.json()["job"]["segment"] is None
    unknown = client.post("/v1/deployments/assist/calibrations", headers=op,
                          json={"segment": "chat"})
    assert unknown.status_code in (400, 422)
    assert "knows no traffic segment 'chat'" in unknown.text
    malformed = client.post("/v1/deployments/assist/calibrations", headers=op,
                            json={"segment": "Not A Name!"})
    assert malformed.status_code == 422


def test_an_automatic_segmented_job_with_too_few_samples_waits_a_manual_one_fails(engine,
                                                                                 outbox):
    start = utcnow() - timedelta(minutes=30)
    with session_scope(engine) as session:
        deployment = make_deployment(session, name="assist")
        for name in ("chat", "code"):
            declare_segment(session=session, deployment=deployment, name=name, actor="test")
        _traffic(session, {"chat": (200, 0.5), "code": (200, 0.5)}, start=start)
        automatic, _ = service.request_calibration(
            session=session, deployment=deployment, actor="test", since=start,
            trigger="alert", policy=POLICY)
        automatic_id = automatic.id
    with session_scope(engine) as session:
        job = session.get(CalibrationJob, automatic_id)
        recalibration.run_calibration(session=session, job=job, policy=POLICY)
        assert job.status == "waiting_for_data", job.status_reason
        assert "no segment could be certified" in job.status_reason
        assert set(job.summary["segments"]) == {"chat", "code"}
        job.status = "failed"  # close it: one open whole-deployment job at a time
    manual = _run(engine, since=start)
    with Session(engine) as session:
        job = session.get(CalibrationJob, manual)
        assert job.status == "failed" and job.result_version is None
        assert "no segment could be certified" in job.status_reason
