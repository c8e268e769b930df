"""The segments a deployment knows: operators declare and remove them up to the cap, a threshold
set declares the segments it maps, and telemetry registers names only where the deployment opted
in (never a removed one); every other name goes to `default`."""

import pytest

from controlplane.deployments import service
from controlplane.deployments.models import AuditEvent
from controlplane.deployments.schemas import DeploymentCreate
from controlplane.deployments.segments import (
    admit_segments,
    declare_segment,
    known_segments,
    readable_segments,
    remove_segment,
)
from controlplane.errors import Conflict, Invalid, NotFound


@pytest.fixture
def deployment(session):
    made = service.create_deployment(session=session, spec=DeploymentCreate(
        name="mix", model_ref="tiny", num_layers=8, exit_layers=[3, 6]), actor="test")
    session.flush()
    return made


def test_telemetry_names_nothing_unless_the_deployment_opted_in(session, deployment):
    assert admit_segments(session=session, deployment_id=deployment.id,
                          names=["code", "default"], limit=3) == {"code": "default",
                                                                   "default": "default"}
    assert known_segments(session=session, deployment_id=deployment.id) == []
    declare_segment(session=session, deployment=deployment, name="code", actor="op")
    assert admit_segments(session=session, deployment_id=deployment.id,
                          names=["code", "chat"], limit=3) == {"code": "code", "chat": "default"}


def test_opted_in_names_are_admitted_up_to_the_cap_and_the_rest_go_to_default(session,
                                                                             deployment):
    first = admit_segments(session=session, deployment_id=deployment.id, auto=True,
                           names=["code", "default", "chat"], limit=3)
    assert first == {"chat": "chat", "code": "code", "default": "default"}
    assert known_segments(session=session, deployment_id=deployment.id) == ["chat", "code"]
    # One slot left: names are admitted in sorted order, so every writer picks the same one.
    second = admit_segments(session=session, deployment_id=deployment.id, auto=True,
                            names=["tools", "retrieval", "chat"], limit=3)
    assert second == {"chat": "chat", "retrieval": "retrieval", "tools": "default"}
    assert known_segments(session=session, deployment_id=deployment.id) == [
        "chat", "code", "retrieval"]
    # A known name stays known whatever the cap is later.
    assert admit_segments(session=session, deployment_id=deployment.id, names=["code"],
                          limit=1) == {"code": "code"}


def test_a_removed_name_stays_readable_and_only_an_operator_brings_it_back(session,
                                                                          deployment):
    admit_segments(session=session, deployment_id=deployment.id, auto=True, names=["squat"])
    remove_segment(session=session, deployment=deployment, name="squat", actor="op",
                   reason="not ours")
    assert known_segments(session=session, deployment_id=deployment.id) == []
    assert readable_segments(session=session, deployment_id=deployment.id) == ["squat"]
    # telemetry cannot register it again, even opted in
    assert admit_segments(session=session, deployment_id=deployment.id, auto=True,
                          names=["squat"]) == {"squat": "default"}
    row = declare_segment(session=session, deployment=deployment, name="squat", actor="op")
    assert row.removed_at is None and row.origin == "operator"
    assert known_segments(session=session, deployment_id=deployment.id) == ["squat"]
    actions = [e.action for e in session.query(AuditEvent).filter_by(
        deployment_id=deployment.id).order_by(AuditEvent.id)]
    assert actions[-2:] == ["segment.remove", "segment.declare"]
    with pytest.raises(NotFound, match="no segment 'nope' in use"):
        remove_segment(session=session, deployment=deployment, name="nope", actor="op")


def test_declarations_stop_at_the_cap_and_removal_makes_room(session, deployment):
    for name in ("a", "b"):
        declare_segment(session=session, deployment=deployment, name=name, actor="op", limit=2)
    declare_segment(session=session, deployment=deployment, name="a", actor="op", limit=2)
    with pytest.raises(Invalid, match=r"already uses 2 segments.*\['c'\].*remove one first"):
        declare_segment(session=session, deployment=deployment, name="c", actor="op", limit=2)
    remove_segment(session=session, deployment=deployment, name="a", actor="op")
    declare_segment(session=session, deployment=deployment, name="c", actor="op", limit=2)
    assert known_segments(session=session, deployment_id=deployment.id) == ["b", "c"]
    for bad in ("default", "Chat", "a/b"):
        with pytest.raises(Invalid):
            declare_segment(session=session, deployment=deployment, name=bad, actor="op")


def test_a_set_declares_its_segments_and_cannot_pass_the_cap(session, deployment):
    declare_segment(session=session, deployment=deployment, name="chat", actor="op")
    service.publish(session=session, deployment=deployment, thresholds={3: 0.9, 6: 0.9},
                    segments={"code": {3: 1.0, 6: 0.95}}, reason="r", actor="test",
                    max_segments=2)
    assert known_segments(session=session, deployment_id=deployment.id) == ["chat", "code"]
    with pytest.raises(Invalid, match=r"already uses 2 segments.*\['tools'\]"):
        service.publish(session=session, deployment=deployment, thresholds={3: 0.9, 6: 0.9},
                        segments={"tools": {3: 1.0, 6: 0.95}}, reason="r", actor="test",
                        max_segments=2)


def test_a_segment_an_aliased_set_maps_cannot_be_removed(session, deployment):
    mapped = service.publish(session=session, deployment=deployment, actor="test", reason="r",
                             thresholds={3: 0.9, 6: 0.9}, segments={"code": {3: 1.0, 6: 0.95}})
    service.move_alias(session=session, deployment=deployment, alias="active",
                       version=mapped.version, actor="test", reason="r")
    with pytest.raises(Conflict, match=r"'code' has thresholds of its own in active \(v2\)"):
        remove_segment(session=session, deployment=deployment, name="code", actor="op")
    plain = service.publish(session=session, deployment=deployment, actor="test", reason="r",
                            thresholds={3: 0.9, 6: 0.9})
    service.move_alias(session=session, deployment=deployment, alias="active",
                       version=plain.version, actor="test", reason="r")
    remove_segment(session=session, deployment=deployment, name="code", actor="op")
    assert known_segments(session=session, deployment_id=deployment.id) == []
