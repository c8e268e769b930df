"""Registry behaviour through the service functions, on SQLite and PostgreSQL."""

import itertools
import threading

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.deployments import service
from controlplane.deployments.models import AuditEvent, Deployment
from controlplane.deployments.schemas import DeploymentCreate
from controlplane.errors import Conflict, Invalid, NotFound

SPEC = DeploymentCreate(name="chat", model_ref="smollm2-135m", num_layers=30)


def _create(session: Session) -> Deployment:
    deployment = service.create_deployment(session=session, spec=SPEC, actor="alice")
    session.commit()
    return deployment


def test_new_deployment_has_a_never_exit_set_active_and_conservative(session):
    deployment = _create(session)
    assert deployment.exit_layers == [12, 15, 18, 21, 24, 27]
    assert service.aliases_of(session=session, deployment=deployment) == {
        "active": 1, "conservative": 1}
    first = service.get_threshold_set(session=session, deployment=deployment, version=1)
    assert set(first.thresholds_by_layer().values()) == {1.0}
    assert first.origin == "fallback"


def test_versions_increase_and_sets_carry_checksum_and_parent(session):
    deployment = _create(session)
    thresholds = dict.fromkeys(deployment.exit_layers, 0.9)
    second = service.publish(session=session, deployment=deployment, thresholds=thresholds,
                             reason="first tune", actor="alice")
    third = service.publish(session=session, deployment=deployment, thresholds=thresholds,
                            reason="again", actor="bob")
    assert (second.version, third.version) == (2, 3)
    assert second.parent_version == 1
    assert second.checksum != third.checksum  # the version is part of what is signed
    wire = service.to_wire(deployment=deployment, threshold_set=third)
    wire.verify()


@pytest.mark.parametrize(("change", "message"), [
    ({12: None}, "missing thresholds for exit layers \\[12\\]"),
    ({7: 0.5}, "unknown exit layers \\[7\\]"),
    ({12: -0.1}, "layer 12 is -0.1"),
])
def test_invalid_sets_are_refused_and_nothing_is_stored(session, change, message):
    deployment = _create(session)
    thresholds = dict.fromkeys(deployment.exit_layers, 0.9)
    for layer, value in change.items():
        if value is None:
            thresholds.pop(layer)
        else:
            thresholds[layer] = value
    with pytest.raises(Invalid, match=message):
        service.publish(session=session, deployment=deployment, thresholds=thresholds,
                        reason="bad", actor="alice")
    session.rollback()
    assert len(service.list_threshold_sets(session=session, deployment=deployment)) == 1


def test_alias_move_and_rollback_write_audit_events(session):
    deployment = _create(session)
    thresholds = dict.fromkeys(deployment.exit_layers, 0.8)
    v2 = service.publish(session=session, deployment=deployment, thresholds=thresholds,
                         reason="tune", actor="alice")
    service.move_alias(session=session, deployment=deployment, alias="active",
                       version=v2.version, actor="alice", reason="go")
    event = service.rollback(session=session, deployment=deployment, actor="bob",
                             reason="too aggressive")
    session.commit()
    assert (event.from_version, event.to_version, event.action) == (2, 1, "alias.rollback")
    assert service.aliases_of(session=session, deployment=deployment)["active"] == 1
    log = service.audit_log(session=session, deployment=deployment)
    assert [e.action for e in log][:2] == ["alias.rollback", "alias.move"]
    assert log[0].actor == "bob" and log[0].reason == "too aggressive"


def test_rollback_without_history_is_a_conflict(session):
    deployment = _create(session)
    with pytest.raises(Conflict, match="no earlier active version"):
        service.rollback(session=session, deployment=deployment, actor="a", reason="r")


def test_unknown_version_and_alias_are_refused(session):
    deployment = _create(session)
    with pytest.raises(NotFound, match="no threshold set version 7"):
        service.move_alias(session=session, deployment=deployment, alias="active", version=7,
                           actor="a", reason="r")
    with pytest.raises(Invalid, match="unknown alias"):
        service.move_alias(session=session, deployment=deployment, alias="primary", version=1,
                           actor="a", reason="r")


def test_duplicate_deployment_is_a_conflict(session):
    _create(session)
    with pytest.raises(Conflict, match="already exists"):
        service.create_deployment(session=session, spec=SPEC, actor="alice")


def test_canary_membership_is_sticky_and_close_to_the_fraction():
    members = [service.in_canary(runtime_id=f"rt-{i}", fraction=0.2) for i in range(5000)]
    again = [service.in_canary(runtime_id=f"rt-{i}", fraction=0.2) for i in range(5000)]
    assert members == again
    assert 0.17 < sum(members) / len(members) < 0.23


def test_concurrent_alias_moves_lose_no_update(engine):
    with Session(engine) as session:
        deployment = _create(session)
        versions = [service.publish(session=session, deployment=deployment,
                                    thresholds=dict.fromkeys(deployment.exit_layers, 0.5 + i / 100),
                                    reason=f"v{i}", actor="a").version for i in range(8)]
        session.commit()
        start_revision = deployment.revision

    errors: list[BaseException] = []
    barrier = threading.Barrier(len(versions))

    def move(version: int) -> None:
        try:
            barrier.wait(timeout=10)
            with Session(engine) as worker:
                target = service.get_deployment(session=worker, name="chat")
                service.move_alias(session=worker, deployment=target, alias="active",
                                   version=version, actor=f"w{version}", reason="race")
                worker.commit()
        except BaseException as error:  # collected and asserted below
            errors.append(error)

    threads = [threading.Thread(target=move, args=(v,)) for v in versions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    with Session(engine) as session:
        deployment = service.get_deployment(session=session, name="chat")
        assert deployment.revision == start_revision + len(versions)
        moves = list(session.scalars(select(AuditEvent).where(
            AuditEvent.action == "alias.move", AuditEvent.alias == "active",
            AuditEvent.reason == "race").order_by(AuditEvent.id)))
        assert len(moves) == len(versions)
        # Each move saw the previous one: the chain of from -> to is unbroken.
        for before, after in itertools.pairwise(moves):
            assert after.from_version == before.to_version
        active = service.aliases_of(session=session, deployment=deployment)["active"]
        assert active == moves[-1].to_version
