"""Alerts name their traffic segment: the dedup key and the open-alert lookup are
per segment, hooks carry the segment, and a 'default' alert carries no segment."""

import json

from sqlalchemy.orm import Session

from controlplane.alerts import delivery_service, hook_service, service
from controlplane.alerts.service import Condition
from tests.support.alerts import make_deployment

BASE = "http://exitplane.test:8000"


def _condition(segment: str) -> Condition:
    return Condition(kind="quality_regression", severity="critical", segment=segment,
                     summary=f"disagreement above δ on {segment}")


def test_one_open_alert_per_segment_and_a_segment_check_clears_only_its_own(session: Session,
                                                                            outbox):
    deployment = make_deployment(session)
    code, created = service.fire(session=session, deployment=deployment,
                                 condition=_condition("code"))
    default, _ = service.fire(session=session, deployment=deployment,
                              condition=_condition("default"))
    assert created and code.id != default.id
    assert (code.segment, code.dedup_key) == ("code", "chat:code:quality_regression:all")
    assert (default.segment, default.dedup_key) == ("default", "chat:quality_regression:all")
    again, created = service.fire(session=session, deployment=deployment,
                                  condition=_condition("code"))
    assert again.id == code.id and not created
    # chat's check saw no quality condition: only chat's alerts (none) start clearing
    service.reconcile(session=session, deployment=deployment, conditions=[],
                      checked_kinds=["quality_regression"], clear_after_s=0, segment="chat")
    assert code.status == default.status == "firing"
    result = service.reconcile(session=session, deployment=deployment, conditions=[],
                               checked_kinds=["quality_regression"], clear_after_s=0,
                               segment="code")
    assert result.resolved == [code] and default.status == "firing"


def test_hooks_carry_the_segment_of_a_segment_alert_only(session: Session, receiver, outbox):
    deployment = make_deployment(session)
    webhook = hook_service.create_hook(session=session, name="ops", kind="webhook",
                                       url=receiver.url + "/hook", actor="test")
    manager = hook_service.create_hook(session=session, name="am", kind="alertmanager",
                                       url=receiver.url + "/am", actor="test")
    for segment in ("code", "default"):
        alert, _ = service.fire(session=session, deployment=deployment,
                                condition=_condition(segment))
        for hook in (webhook, manager):
            assert delivery_service.deliver(session=session, alert_id=alert.id,
                                            hook_id=hook.id, event="firing", base_url=BASE,
                                            timeout_s=5).ok
    posted = [json.loads(r.body) for r in receiver.requests]
    code_hook, code_am, default_hook, default_am = posted
    assert code_hook["alert"]["segment"] == "code"
    assert code_am[0]["labels"]["segment"] == "code"
    assert "segment" not in default_hook["alert"]
    assert "segment" not in default_am[0]["labels"]
