"""Held heartbeats (controlplane/runtimes/beats.py): written by the flusher on its
own, never over a newer stored beat, and kept through a store outage."""

from __future__ import annotations

from datetime import timedelta

from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from controlplane.db import session_factory, utcnow
from controlplane.deployments.service import get_deployment
from controlplane.runtimes import service
from controlplane.runtimes.beats import HeartbeatBuffer
from controlplane.runtimes.models import Runtime
from controlplane.runtimes.schemas import RuntimeRead
from exitplane.app import create_app
from exitplane.wire import Heartbeat
from tests.support.deployments import deploy_for_telemetry
from tests.support.waiting import wait_until


def _stored(engine, runtime_id: str) -> Runtime:
    with Session(engine) as session:
        return session.scalars(select(Runtime).where(Runtime.runtime_id == runtime_id)).one()


def _recorded(engine, runtime_id: str) -> tuple[int, RuntimeRead]:
    """A runtime's first beat, stored as the store path stores it: (deployment id, row)."""
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        row = service.record_heartbeat(session=session, deployment=deployment,
                                       beat=Heartbeat(runtime_id=runtime_id, applied_version=1))
        answer = RuntimeRead.model_validate(row)
        session.commit()
        return deployment.id, answer


def test_the_flusher_writes_held_beats_on_its_own(settings, engine, tokens):
    app = create_app(settings.model_copy(update={"heartbeat_flush_s": 0.2}), engine=engine)
    with TestClient(app) as client:
        runtime = deploy_for_telemetry(client, tokens, engine)
        path = "/v1/deployments/chat/heartbeats"
        assert client.post(path, headers=runtime, json={"runtime_id": "rt-1"}).status_code == 200
        told = client.post(path, headers=runtime, json={"runtime_id": "rt-1",
                                                        "applied_version": 2})
        assert told.status_code == 200
        wait_until(lambda: _stored(engine, "rt-1").applied_version == 2, 10,
                   "the flusher to write the held beat")
        assert RuntimeRead.model_validate(_stored(engine, "rt-1")).model_dump(
            mode="json") == told.json()
    app.state.heartbeats.close()


def test_a_held_beat_never_overwrites_a_newer_stored_one(engine, tokens, settings):
    app = create_app(settings, engine=engine)
    with TestClient(app) as client:
        deploy_for_telemetry(client, tokens, engine)
    deployment_id, first = _recorded(engine, "rt-1")
    buffer = HeartbeatBuffer(session_factory(engine), interval_s=60)
    buffer.remember(deployment_id, first, None)
    held_at = utcnow()
    buffer.keep(deployment_id, Heartbeat(runtime_id="rt-1", applied_version=2), held_at,
                first.first_seen)
    # Meanwhile another API process stores a later beat of the same runtime.
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        service.record_heartbeat(session=session, deployment=deployment,
                                 beat=Heartbeat(runtime_id="rt-1", applied_version=3))
        session.commit()
    assert buffer.flush() == 1
    assert _stored(engine, "rt-1").applied_version == 3
    # A held beat later than the stored one is written.
    buffer.keep(deployment_id, Heartbeat(runtime_id="rt-1", applied_version=4),
                utcnow() + timedelta(seconds=1), first.first_seen)
    assert buffer.flush() == 1
    assert _stored(engine, "rt-1").applied_version == 4
    buffer.close()


def test_beats_held_through_a_store_outage_are_written_once_it_is_back(engine, tokens,
                                                                        settings):
    app = create_app(settings, engine=engine)
    with TestClient(app) as client:
        deploy_for_telemetry(client, tokens, engine)
    deployment_id, first = _recorded(engine, "rt-1")
    factory = session_factory(engine)
    away = {"now": True}

    def store():
        if away["now"]:
            raise OperationalError("connect", {}, ConnectionRefusedError("the store is away"))
        return factory()

    buffer = HeartbeatBuffer(store, interval_s=60)
    buffer.remember(deployment_id, first, None)
    buffer.keep(deployment_id, Heartbeat(runtime_id="rt-1", applied_version=2), utcnow(),
                first.first_seen)
    try:
        buffer.flush()
    except OperationalError:
        pass
    else:
        raise AssertionError("a flush with the store away must say so")
    # A newer beat of the same runtime replaces the one held; the store comes back.
    buffer.keep(deployment_id, Heartbeat(runtime_id="rt-1", applied_version=5), utcnow(),
                first.first_seen)
    away["now"] = False
    assert buffer.flush() == 1
    assert _stored(engine, "rt-1").applied_version == 5
    assert buffer.flush() == 0
    buffer.close()
