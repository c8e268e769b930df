"""The deployment row lock (controlplane/deployments/locks.py) serialises the control plane's
read-modify-writes without waiting for the fleet's writes: a transaction that inserted rows
referencing the deployment (telemetry, heartbeats) holds a key-share lock on it, which the
lock must not wait for (it did as FOR UPDATE), while two control writers still serialise."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from controlplane.deployments import service
from controlplane.deployments.schemas import DeploymentCreate
from controlplane.telemetry import service as telemetry
from exitplane.wire import TelemetryBatch
from tests.support.batches import telemetry_batch

# Row locks are PostgreSQL's (SQLite serialises every writer with BEGIN IMMEDIATE).
pytestmark = pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)


@pytest.fixture
def deployed(engine):
    with Session(engine) as session:
        deployment = service.create_deployment(session=session, actor="test", spec=(
            DeploymentCreate(name="chat", model_ref="tiny", num_layers=8, exit_layers=[3, 6])))
        service.publish(session=session, deployment=deployment, thresholds={3: 0.9, 6: 0.9},
                        reason="first", actor="test")
        session.commit()
    return engine


def _publish_and_activate(engine) -> int:
    with Session(engine) as session:
        session.execute(text("SET LOCAL lock_timeout = '2s'"))
        deployment = service.get_deployment(session=session, name="chat", lock=True)
        made = service.publish(session=session, deployment=deployment,
                               thresholds={3: 0.8, 6: 0.8}, reason="move", actor="op")
        service.move_alias(session=session, deployment=deployment, alias="active",
                           version=made.version, actor="op", reason="move")
        session.commit()
        return made.version


def _batch() -> TelemetryBatch:
    now = time.time()
    return TelemetryBatch.model_validate(telemetry_batch([
        {"threshold_version": 1, "request_id": "r", "position": i, "exit_layer": 8,
         "signal_value": 0.5, "latency_us": 900, "ts": now} for i in range(5)], num_layers=8))


def test_an_alias_move_does_not_wait_for_a_fleet_write_in_flight(deployed):
    with Session(deployed) as fleet:  # an ingest transaction, not committed yet
        deployment = service.get_deployment(session=fleet, name="chat")
        telemetry.ingest(session=fleet, deployment=deployment, batches=[_batch()])
        fleet.flush()  # its rows reference the deployment: a key-share lock on its row
        version = _publish_and_activate(deployed)  # FOR UPDATE timed out here after 2 s
        fleet.commit()
    with Session(deployed) as session:
        deployment = service.get_deployment(session=session, name="chat")
        assert service.aliases_of(session=session, deployment=deployment)["active"] == version
        assert session.scalar(text("SELECT count(*) FROM token_records")) == 5


def test_two_control_writers_still_serialise(deployed):
    with Session(deployed) as first:
        service.get_deployment(session=first, name="chat", lock=True)
        with pytest.raises(OperationalError, match="lock timeout"):
            _publish_and_activate(deployed)
        first.rollback()
    assert _publish_and_activate(deployed) == 3
