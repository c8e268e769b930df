"""Automatic fallback: an alert that puts quality at risk makes a conservative set active in the
same transaction, names the alert in the audit log, queues a recalibration and says so."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.alerts.models import Alert
from controlplane.calibration.models import CalibrationJob
from controlplane.db import session_scope, utcnow
from controlplane.deployments.models import AuditEvent, ThresholdSet
from controlplane.deployments.service import (
    aliases_of,
    get_deployment,
    get_threshold_set,
    move_alias,
    publish,
)
from controlplane.flows import fallback
from controlplane.flows.canary import start_canary
from tests.support.calibration import (
    BAD,
    GOOD,
    fire_alert,
    make_deployment,
    separable_samples,
    write_traffic,
)


def _activate(session, thresholds, reason="tuned"):
    deployment = get_deployment(session=session, name="chat")
    version = publish(session=session, deployment=deployment, thresholds=thresholds,
                      reason=reason, actor="ops").version
    move_alias(session=session, deployment=deployment, alias="active", version=version,
               actor="ops", reason=reason)
    return version


def test_quality_regression_makes_the_conservative_set_active_at_once(engine, outbox):
    with session_scope(engine) as session:
        make_deployment(session)
        assert _activate(session, GOOD) == 2
    alert_id = fire_alert(engine)
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        assert aliases_of(session=session, deployment=deployment)["active"] == 1
        event = session.scalars(select(AuditEvent).where(
            AuditEvent.action == "alias.fallback")).one()
        assert (event.from_version, event.to_version, event.actor) == (2, 1, "system:fallback")
        assert event.details["alert_id"] == alert_id and f"alert {alert_id}" in event.reason
        job = session.scalars(select(CalibrationJob)).one()
        alert = session.get(Alert, alert_id)
        assert (job.trigger, job.alert_id, job.status) == ("alert", alert_id, "queued")
        assert job.since == alert.fired_at
        assert alert.action_taken == (f"rule quality_regression: quality regression falls "
                                      f"back at once; fallback engaged: active 2 -> 1 "
                                      f"(conservative set); recalibration job {job.id} queued")
    assert ("calibration.run", [job.id]) in outbox


def test_exit_rate_spike_falls_back_too_and_a_second_call_changes_nothing(engine, outbox):
    with session_scope(engine) as session:
        make_deployment(session)
        _activate(session, GOOD)
    alert_id = fire_alert(engine, kind="exit_rate_spike")
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        again = fallback.engage_fallback(session=session, deployment=deployment,
                                         alert=session.get(Alert, alert_id))
        assert not again.moved and again.to_version == 1
    with Session(engine) as session:
        assert len(session.scalars(select(AuditEvent).where(
            AuditEvent.action == "alias.fallback")).all()) == 1
        assert len(session.scalars(select(CalibrationJob)).all()) == 1


def test_last_good_republishes_the_last_version_within_delta_with_a_margin(engine, outbox):
    signals, matched = separable_samples(1000, seed=3)  # exits above 0.5 always match
    start = utcnow() - timedelta(hours=2)
    with session_scope(engine) as session:
        make_deployment(session, fallback_mode="last_good", fallback_margin=0.05)
        good = _activate(session, GOOD)
        write_traffic(session, "chat", signals, matched, start=start, version=good,
                      thresholds=GOOD, shadow_every=2)
        bad = _activate(session, BAD, reason="too aggressive")
        write_traffic(session, "chat", signals, matched, start=start + timedelta(hours=1),
                      version=bad, thresholds=BAD, shadow_every=2)
    alert_id = fire_alert(engine)
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        active = aliases_of(session=session, deployment=deployment)["active"]
        fallback_set = get_threshold_set(session=session, deployment=deployment, version=active)
        assert active == 4 and fallback_set.origin == "fallback"
        assert fallback_set.parent_version == good
        assert fallback_set.thresholds_by_layer() == pytest.approx({3: 0.95, 6: 0.85, 9: 0.75})
        assert fallback_set.expected_metrics["alert_id"] == alert_id
        assert "last good version 2" in session.get(Alert, alert_id).action_taken


def test_last_good_without_a_qualifying_version_uses_the_conservative_set(engine, outbox):
    with session_scope(engine) as session:
        make_deployment(session, fallback_mode="last_good")
        _activate(session, GOOD)  # never saw traffic: not known to be good
        _activate(session, BAD)
    fire_alert(engine)
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        assert aliases_of(session=session, deployment=deployment)["active"] == 1


def test_exit_rate_collapse_only_queues_a_recalibration(engine, outbox):
    with session_scope(engine) as session:
        make_deployment(session)
        _activate(session, GOOD)
    alert_id = fire_alert(engine, kind="exit_rate_collapse")
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        assert aliases_of(session=session, deployment=deployment)["active"] == 2
        job = session.scalars(select(CalibrationJob)).one()
        assert "recalibration job" in session.get(Alert, alert_id).action_taken
    assert ("calibration.run", [job.id]) in outbox


def test_fallback_stops_a_running_canary(engine, outbox):
    with session_scope(engine) as session:
        deployment = make_deployment(session)
        _activate(session, GOOD)
        candidate = publish(session=session, deployment=deployment, thresholds=BAD,
                            reason="candidate", actor="ops").version
        start_canary(session=session, deployment=deployment, version=candidate, actor="ops")
    fire_alert(engine)
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        assert aliases_of(session=session, deployment=deployment) == {
            "active": 1, "conservative": 1}


def test_a_failing_reaction_still_fires_the_alert_and_says_so(engine, outbox, monkeypatch):
    with session_scope(engine) as session:
        make_deployment(session)
        _activate(session, GOOD)

    def broken(**kwargs):
        raise RuntimeError("store hiccup")

    monkeypatch.setattr(fallback, "engage_fallback", broken)
    alert_id = fire_alert(engine)
    with Session(engine) as session:
        alert = session.get(Alert, alert_id)
        assert alert.status == "firing"
        assert alert.action_taken.startswith("automatic fallback FAILED (RuntimeError")


def test_last_good_skips_a_version_that_fails_on_the_traffic_that_fired(engine, outbox):
    now = utcnow()
    old_signals, old_matched = separable_samples(1000, seed=3)
    new_signals, new_matched = separable_samples(600, seed=4, mismatch_below=0.97)
    with session_scope(engine) as session:
        make_deployment(session, fallback_mode="last_good")
        good = _activate(session, GOOD)
        write_traffic(session, "chat", old_signals, old_matched, version=good, thresholds=GOOD,
                      start=now - timedelta(hours=2), shadow_every=2)
        bad = _activate(session, BAD)
        # The new traffic: only near-certain early answers match, so GOOD's exits go wrong.
        write_traffic(session, "chat", new_signals, new_matched, version=bad, thresholds=BAD,
                      start=now - timedelta(minutes=5), spacing_s=0.2)
    fire_alert(engine)
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        assert aliases_of(session=session, deployment=deployment)["active"] == 1
        assert session.scalars(select(ThresholdSet).where(
            ThresholdSet.origin == "fallback", ThresholdSet.version > 1)).all() == []


def _gate(*, tokens: int, requests: int, disagreements: int, upper_bound: float) -> dict:
    """The clustered shadow evidence `controlplane.drift.service` puts on an exit-rate spike."""
    return {"quality_gate": {"shadow_tokens": tokens, "requests": requests,
                             "disagreements": disagreements,
                             "disagreement_rate": disagreements / tokens,
                             "design_effect": 3.0, "effective_tokens": tokens / 3,
                             "upper_bound": upper_bound, "confidence": 0.95, "delta": 0.05}}


def test_spike_whose_shadow_tokens_stay_within_delta_keeps_the_active_set(engine, outbox):
    # The case: 9 / 1,158 shadow tokens disagree (0.8%, δ = 5%) in the spike's window.
    with session_scope(engine) as session:
        make_deployment(session)
        _activate(session, GOOD)
    alert_id = fire_alert(engine, kind="exit_rate_spike",
                          evidence=_gate(tokens=1158, requests=40, disagreements=9,
                                         upper_bound=0.021))
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        assert aliases_of(session=session, deployment=deployment)["active"] == 2
        assert session.scalars(select(AuditEvent).where(
            AuditEvent.action == "alias.fallback")).all() == []
        job = session.scalars(select(CalibrationJob)).one()
        alert = session.get(Alert, alert_id)
        assert (job.trigger, job.alert_id) == ("alert", alert_id)
        assert alert.action_taken.startswith("rule shadow_upper_bound_within_delta: 9/1158 ")
        assert "95% upper bound 2.10%" in alert.action_taken
        assert f"the active set stays; recalibration job {job.id} queued" in alert.action_taken
    assert ("calibration.run", [job.id]) in outbox


@pytest.mark.parametrize(("gate", "rule"), [
    (_gate(tokens=1158, requests=40, disagreements=40, upper_bound=0.061),
     "shadow_upper_bound_above_delta"),
    (_gate(tokens=150, requests=40, disagreements=0, upper_bound=0.02),
     "too_few_shadow_tokens"),
    (_gate(tokens=1158, requests=5, disagreements=0, upper_bound=0.02),
     "too_few_shadow_tokens"),
    ({"adjusted_p_value": 1e-9}, "no_quality_evidence"),
])
def test_spike_without_shadow_evidence_of_quality_falls_back(engine, outbox, gate, rule):
    with session_scope(engine) as session:
        make_deployment(session)
        _activate(session, GOOD)
    alert_id = fire_alert(engine, kind="exit_rate_spike", evidence=gate)
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        assert aliases_of(session=session, deployment=deployment)["active"] == 1
        action = session.get(Alert, alert_id).action_taken
        assert action.startswith(f"rule {rule}: ") and "fallback engaged: active 2 -> 1" in action


def test_a_kept_spike_falls_back_once_a_later_window_cannot_show_quality(engine, outbox):
    with session_scope(engine) as session:
        make_deployment(session)
        _activate(session, GOOD)
    alert_id = fire_alert(engine, kind="exit_rate_spike",
                          evidence=_gate(tokens=1158, requests=40, disagreements=9,
                                         upper_bound=0.021))
    with session_scope(engine) as session:
        alert = session.get(Alert, alert_id)
        still_fine = _gate(tokens=900, requests=35, disagreements=8, upper_bound=0.03)
        assert not fallback.recheck_spike(session=session, alert=alert,
                                          quality_gate=still_fine["quality_gate"])
        deployment = get_deployment(session=session, name="chat")
        assert aliases_of(session=session, deployment=deployment)["active"] == 2
        worse = _gate(tokens=900, requests=35, disagreements=40, upper_bound=0.062)
        assert fallback.recheck_spike(session=session, alert=alert,
                                      quality_gate=worse["quality_gate"])
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        assert aliases_of(session=session, deployment=deployment)["active"] == 1
        action = session.get(Alert, alert_id).action_taken
        assert "re-checked: rule shadow_upper_bound_above_delta" in action
        assert "fallback engaged: active 2 -> 1" in action
