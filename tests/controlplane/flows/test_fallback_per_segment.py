"""A regression in one traffic segment falls back that segment alone: the version
the fallback publishes changes only that segment's map (never exit, or its last good
thresholds raised by the margin, judged on its own traffic); default and every other segment
keep theirs, and the recalibration it queues is that segment's."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.alerts.models import Alert
from controlplane.alerts.service import Condition, fire
from controlplane.calibration.models import CalibrationJob
from controlplane.db import session_scope, utcnow
from controlplane.deployments.service import (
    aliases_of,
    get_deployment,
    get_threshold_set,
    move_alias,
    publish,
    to_wire,
)
from tests.support.calibration import make_deployment, separable_samples, write_traffic

GOOD = {3: 0.9, 6: 0.8, 9: 0.7}
BAD = {3: 0.1, 6: 0.1, 9: 0.1}
CHAT = {3: 0.85, 6: 0.75, 9: 0.65}


def _activate(session, *, thresholds, segments, reason):
    deployment = get_deployment(session=session, name="assist")
    version = publish(session=session, deployment=deployment, thresholds=thresholds,
                      segments=segments, reason=reason, actor="ops").version
    move_alias(session=session, deployment=deployment, alias="active", version=version,
               actor="ops", reason=reason)
    return version


def _fire(engine, segment: str) -> int:
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="assist")
        alert, created = fire(session=session, deployment=deployment, condition=Condition(
            kind="quality_regression", severity="critical", segment=segment,
            summary=f"segment {segment}: disagreement above δ", evidence={"segment": segment}))
        assert created
        return alert.id


def test_last_good_falls_back_code_alone_to_its_last_good_thresholds(engine, outbox):
    signals, matched = separable_samples(1000, seed=3)
    now = utcnow()
    with session_scope(engine) as session:
        deployment = make_deployment(session, name="assist", fallback_mode="last_good",
                                     fallback_margin=0.05)
        # code's map was good; default's map of that version was not, on default's traffic
        # (so the version as a whole, summed over its segments, looks bad)
        good = _activate(session, thresholds=BAD, segments={"code": GOOD, "chat": CHAT},
                         reason="good for code")
        write_traffic(session, "assist", signals, matched, start=now - timedelta(hours=2),
                      version=good, thresholds=GOOD, shadow_every=2, runtime_id="rt-code",
                      segment="code")
        write_traffic(session, "assist", signals, matched, start=now - timedelta(hours=2),
                      version=good, thresholds=BAD, shadow_every=2, runtime_id="rt-default")
        bad = _activate(session, thresholds=GOOD, segments={"code": BAD, "chat": CHAT},
                        reason="code too aggressive")
        write_traffic(session, "assist", signals, matched, start=now - timedelta(minutes=5),
                      version=bad, thresholds=BAD, shadow_every=2, runtime_id="rt-code-2",
                      segment="code")
    alert_id = _fire(engine, "code")
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="assist")
        active = aliases_of(session=session, deployment=deployment)["active"]
        assert active == bad + 1
        fallen = get_threshold_set(session=session, deployment=deployment, version=active)
        assert fallen.origin == "fallback" and fallen.parent_version == bad
        assert fallen.segments_by_layer()["code"] == pytest.approx({3: 0.95, 6: 0.85, 9: 0.75})
        assert fallen.segments_by_layer()["chat"] == CHAT
        assert fallen.thresholds_by_layer() == GOOD
        assert fallen.expected_metrics["fallback"] == {
            "segment": "code", "alert_id": alert_id, "from_version": bad,
            "source_version": good, "margin": 0.05}
        to_wire(deployment=deployment, threshold_set=fallen).verify()
        alert = session.get(Alert, alert_id)
        assert alert.segment == "code"
        assert (f"fallback engaged for segment code only: active {bad} -> {active} (code: last "
                f"good version {good}'s thresholds raised") in alert.action_taken
        [job] = session.scalars(select(CalibrationJob)).all()
        assert job.segment == "code" and job.alert_id == alert_id


def test_a_default_regression_keeps_the_other_segments_maps(engine, outbox):
    with session_scope(engine) as session:
        make_deployment(session, name="assist")
        current = _activate(session, thresholds=GOOD, segments={"chat": CHAT}, reason="tuned")
    alert_id = _fire(engine, "default")
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="assist")
        active = aliases_of(session=session, deployment=deployment)["active"]
        assert active == current + 1  # not the conservative version 1: chat keeps exiting
        fallen = get_threshold_set(session=session, deployment=deployment, version=active)
        assert fallen.thresholds_by_layer() == {3: 1.0, 6: 1.0, 9: 1.0}
        assert fallen.segments_by_layer() == {"chat": CHAT}
        alert = session.get(Alert, alert_id)
        assert "fallback engaged for segment default only" in alert.action_taken
        [job] = session.scalars(select(CalibrationJob)).all()
        assert job.segment == "default"


def test_a_second_fallback_of_the_same_segment_publishes_nothing_new(engine, outbox):
    with session_scope(engine) as session:
        make_deployment(session, name="assist")
        _activate(session, thresholds=GOOD, segments={"code": BAD}, reason="tuned")
    _fire(engine, "code")
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="assist")
        first = aliases_of(session=session, deployment=deployment)["active"]
        # the alert resolves; a new one for code fires while code already never exits
        alert = session.scalars(select(Alert)).one()
        alert.open_key, alert.status = None, "resolved"
        session.commit()
    second = _fire(engine, "code")
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="assist")
        assert aliases_of(session=session, deployment=deployment)["active"] == first
        assert "segment code already applies conservative thresholds" in session.get(
            Alert, second).action_taken
