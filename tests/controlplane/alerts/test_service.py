"""Alert lifecycle: dedup while open, acknowledge, manual and automatic resolve, and the
deliveries each transition enqueues (after the commit only)."""

from datetime import timedelta

import pytest
from sqlalchemy.orm import Session

from controlplane.alerts import delivery_service, hook_service, service
from controlplane.alerts.models import AlertDelivery
from controlplane.alerts.service import Condition
from controlplane.db import utcnow
from controlplane.errors import Conflict, Invalid
from tests.support.alerts import make_deployment

SPIKE = Condition(kind="exit_rate_spike", severity="critical", subject="8", layer=8,
                  summary="exit rate at layer 8 rose", evidence={"p_value": 1e-9,
                                                                 "statistic": float("inf")})


def _deliveries(outbox):
    """The delivery tasks sent (the fallback may send a calibration task too)."""
    return [args for name, args in outbox if name == "alerts.deliver"]


def _hooks(session, deployment):
    page = hook_service.create_hook(session=session, name="pager", kind="pagerduty",
                                    url="http://127.0.0.1:9/pd", routing_key="rk", actor="test",
                                    deployment=deployment, min_severity="critical")
    chat = hook_service.create_hook(session=session, name="chat", kind="slack",
                                    url="http://127.0.0.1:9/slack", actor="test",
                                    min_severity="warning")
    quiet = hook_service.create_hook(session=session, name="off", kind="slack",
                                     url="http://127.0.0.1:9/off", actor="test", enabled=False)
    return page, chat, quiet


def test_one_open_alert_per_key_and_a_new_one_after_resolve(session: Session, outbox):
    deployment = make_deployment(session)
    page, chat, _ = _hooks(session, deployment)
    first, created = service.fire(session=session, deployment=deployment, condition=SPIKE)
    assert created and first.status == "firing" and first.dedup_key == "chat:exit_rate_spike:8"
    assert first.evidence == {"p_value": 1e-9, "statistic": None}  # JSON-safe evidence
    assert outbox == []  # nothing is sent before the commit
    session.commit()
    assert sorted(_deliveries(outbox)) == [[first.id, page.id, "firing"],
                                           [first.id, chat.id, "firing"]]

    again, created = service.fire(session=session, deployment=deployment, condition=SPIKE)
    assert (again.id, created) == (first.id, False)
    service.acknowledge(session=session, alert=first, actor="token:ops", note="looking")
    assert first.status == "acknowledged" and first.acknowledged_by == "token:ops"
    again, created = service.fire(session=session, deployment=deployment, condition=SPIKE)
    assert (again.id, created) == (first.id, False)  # acknowledged is still open

    service.resolve(session=session, alert=first, actor="token:ops", reason="fixed upstream")
    with pytest.raises(Conflict):
        service.resolve(session=session, alert=first, actor="token:ops", reason="twice")
    with pytest.raises(Conflict):
        service.acknowledge(session=session, alert=first, actor="token:ops")
    reopened, created = service.fire(session=session, deployment=deployment, condition=SPIKE)
    assert created and reopened.id != first.id
    session.commit()
    events = [(args[0], args[2]) for args in _deliveries(outbox)]
    assert events.count((first.id, "acknowledged")) == 2
    assert events.count((first.id, "resolved")) == 2
    assert events.count((reopened.id, "firing")) == 2


def test_severity_filter_and_rollback_drops_the_outbox(session: Session, outbox):
    deployment = make_deployment(session)
    _, chat, _ = _hooks(session, deployment)
    session.commit()
    warning = Condition(kind="exit_rate_collapse", severity="warning", subject="4", layer=4,
                        summary="exit rate at layer 4 fell")
    alert, _ = service.fire(session=session, deployment=deployment, condition=warning)
    session.rollback()
    assert outbox == []
    alert, _ = service.fire(session=session, deployment=deployment, condition=warning)
    session.commit()
    assert _deliveries(outbox) == [[alert.id, chat.id, "firing"]]  # the pager wants critical


def test_condition_that_clears_resolves_after_the_clear_period(session: Session, outbox):
    deployment = make_deployment(session)
    now = utcnow()
    result = service.reconcile(session=session, deployment=deployment, conditions=[SPIKE],
                               checked_kinds=["exit_rate_spike"], clear_after_s=60, now=now)
    alert = result.fired[0]
    later = now + timedelta(seconds=30)
    result = service.reconcile(session=session, deployment=deployment, conditions=[],
                               checked_kinds=["exit_rate_spike"], clear_after_s=60, now=later)
    assert result.resolved == [] and alert.clear_since == later and alert.status == "firing"
    # Seen again: the clear period starts over.
    service.reconcile(session=session, deployment=deployment, conditions=[SPIKE],
                      checked_kinds=["exit_rate_spike"], clear_after_s=60,
                      now=now + timedelta(seconds=40))
    assert alert.clear_since is None
    # Kinds that were not checked (too little data) never clear.
    service.reconcile(session=session, deployment=deployment, conditions=[],
                      checked_kinds=["quality_regression"], clear_after_s=0,
                      now=now + timedelta(seconds=50))
    assert alert.status == "firing" and alert.clear_since is None
    service.reconcile(session=session, deployment=deployment, conditions=[],
                      checked_kinds=["exit_rate_spike"], clear_after_s=60,
                      now=now + timedelta(seconds=60))
    result = service.reconcile(session=session, deployment=deployment, conditions=[],
                               checked_kinds=["exit_rate_spike"], clear_after_s=60,
                               now=now + timedelta(seconds=121))
    assert result.resolved == [alert]
    assert alert.status == "resolved" and alert.resolved_by == "system"
    assert alert.open_key is None and "cleared for 60 s" in alert.resolution


def test_invalid_input_is_refused_with_a_reason(session: Session):
    deployment = make_deployment(session)
    with pytest.raises(Invalid, match="routing_key"):
        hook_service.create_hook(session=session, name="pd", kind="pagerduty", url="http://x",
                                 actor="t")
    with pytest.raises(Invalid, match="unknown hook kind"):
        hook_service.create_hook(session=session, name="x", kind="email", url="http://x", actor="t")
    with pytest.raises(Invalid, match="unknown alert kind"):
        service.fire(session=session, deployment=deployment,
                     condition=Condition(kind="boom", severity="warning", summary="x"))
    webhook = hook_service.create_hook(session=session, name="w", kind="webhook",
                                       url="https://hooks.example.com/x", actor="t")
    assert len(hook_service.hook_target(hook=webhook, guard=hook_service.hook_guard()).secret) >= 32


def test_a_sweep_finds_events_whose_send_was_lost(session: Session, outbox):
    deployment = make_deployment(session)
    page, chat, _ = _hooks(session, deployment)
    alert, _ = service.fire(session=session, deployment=deployment, condition=SPIKE)
    session.commit()  # imagine the broker was away: the sends in the outbox were lost
    window = {"since": utcnow() - timedelta(days=1), "before": utcnow() + timedelta(seconds=1)}
    assert sorted(delivery_service.undelivered(session=session, **window)) == [
        (alert.id, page.id, "firing"), (alert.id, chat.id, "firing")]
    session.add(AlertDelivery(hook_id=page.id, alert_id=alert.id, event="firing", attempt=1,
                              ok=False, status_code=500, error="HTTP 500", duration_ms=1.0))
    service.resolve(session=session, alert=alert, actor="token:ops", reason="done")
    late = hook_service.create_hook(session=session, name="late", kind="slack",
                                    url="http://127.0.0.1:9/late", actor="test")
    session.flush()
    window["before"] = utcnow() + timedelta(seconds=1)
    found = sorted(delivery_service.undelivered(session=session, **window))
    assert found == [(alert.id, page.id, "resolved"), (alert.id, chat.id, "firing"),
                     (alert.id, chat.id, "resolved")]
    assert all(hook_id != late.id for _, hook_id, _ in found)  # created after the events
