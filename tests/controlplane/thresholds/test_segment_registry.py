"""The segments a deployment knows (issue 18): traffic and threshold sets register names up to
the cap, later names go to `default`, and a set cannot name a segment the cap keeps out."""

import pytest

from controlplane.errors import Invalid
from controlplane.thresholds import service
from controlplane.thresholds.schemas import DeploymentCreate
from controlplane.thresholds.segments import admit_segments, known_segments


@pytest.fixture
def deployment(session):
    made = service.create_deployment(session=session, spec=DeploymentCreate(
        name="mix", model_ref="tiny", num_layers=8, exit_layers=[3, 6]), actor="test")
    session.flush()
    return made


def test_names_are_admitted_up_to_the_cap_and_the_rest_go_to_default(session, deployment):
    first = admit_segments(session=session, deployment_id=deployment.id,
                           names=["code", "default", "chat"], limit=3)
    assert first == {"chat": "chat", "code": "code", "default": "default"}
    assert known_segments(session=session, deployment_id=deployment.id) == ["chat", "code"]
    # One slot left: names are admitted in sorted order, so every writer picks the same one.
    second = admit_segments(session=session, deployment_id=deployment.id,
                            names=["tools", "retrieval", "chat"], limit=3)
    assert second == {"chat": "chat", "retrieval": "retrieval", "tools": "default"}
    assert known_segments(session=session, deployment_id=deployment.id) == [
        "chat", "code", "retrieval"]
    # A known name stays known whatever the cap is later.
    assert admit_segments(session=session, deployment_id=deployment.id, names=["code"],
                          limit=1) == {"code": "code"}


def test_a_set_registers_its_segments_and_cannot_pass_the_cap(session, deployment):
    admit_segments(session=session, deployment_id=deployment.id, names=["chat"], limit=2)
    service.publish(session=session, deployment=deployment, thresholds={3: 0.9, 6: 0.9},
                    segments={"code": {3: 1.0, 6: 0.95}}, reason="r", actor="test",
                    max_segments=2)
    assert known_segments(session=session, deployment_id=deployment.id) == ["chat", "code"]
    with pytest.raises(Invalid, match=r"already knows 2 segments.*\['tools'\]"):
        service.publish(session=session, deployment=deployment, thresholds={3: 0.9, 6: 0.9},
                        segments={"tools": {3: 1.0, 6: 0.95}}, reason="r", actor="test",
                        max_segments=2)
