"""What one runtime token can do to the fleet: it cannot tell which deployments exist (403 for
every one it cannot see, existing or not: no 404 against 403), it cannot take a deployment's
whole cap of runtimes (the cap is per token too, and runtimes heard from once are forgotten
quickly), operators can remove runtimes, and concurrent first heartbeats of one runtime upsert
cleanly on PostgreSQL (a unique violation answered 500)."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.runtimes.models import Runtime
from controlplane.runtimes.service import RuntimeCaps, record_heartbeat
from exitplane.wire import Heartbeat
from tests.support.batches import random_batch
from tests.support.deployments import deploy_for_telemetry, issue_runtime_token
from tests.support.waiting import patient_get

BEATS = "/v1/deployments/{}/heartbeats"


def _beat(client, auth, runtime_id: str, deployment: str = "chat", **fields):
    return client.post(BEATS.format(deployment), headers=auth,
                       json={"runtime_id": runtime_id, **fields})


def _runtime_ids(engine) -> set[str]:
    with Session(engine) as session:
        return set(session.scalars(select(Runtime.runtime_id)))


@pytest.mark.parametrize("fast_path", [True, False])
def test_a_runtime_token_cannot_tell_which_deployments_exist(serve, tokens, engine, fast_path):
    client = serve(telemetry_fast_path=fast_path)
    auth = deploy_for_telemetry(client, tokens, engine, "chat")
    deploy_for_telemetry(client, tokens, engine, "other")
    rng = random.Random(3)

    def answers(name: str) -> list[tuple[int, str]]:
        batch = random_batch(rng, n=5, deployment=name)
        found = [
            client.get(f"/v1/deployments/{name}", headers=auth),
            _beat(client, auth, "rt-1", deployment=name),
            client.get(f"/v1/deployments/{name}/thresholds", headers=auth,
                       params={"runtime_id": "rt-1"}),
            patient_get(client, f"/v1/deployments/{name}/telemetry/count", headers=auth),
            client.get(f"/v1/deployments/{name}/segments", headers=auth),
            client.post("/v1/telemetry", headers=auth, json=batch),
        ]
        return [(answer.status_code, answer.json()["detail"]) for answer in found]

    existing, missing = answers("other"), answers("no-such-deployment")
    assert {status for status, _ in existing} == {403}, existing
    assert missing == existing  # the same status and message: nothing to tell them apart
    # Its own deployment still answers, and operators still get 404 for a missing one.
    assert _beat(client, auth, "rt-1").status_code == 200
    operator = tokens.headers(tokens.operator)
    assert client.get("/v1/deployments/no-such-deployment", headers=operator).status_code == 404


def test_one_token_cannot_take_the_deployment_s_whole_cap(serve, tokens, engine):
    client = serve(max_runtimes_per_deployment=5, max_runtimes_per_token=2)
    leaked = deploy_for_telemetry(client, tokens, engine)
    honest = issue_runtime_token(engine)[1]
    assert [_beat(client, leaked, f"junk-{i}").status_code for i in range(2)] == [200, 200]
    refused = _beat(client, leaked, "junk-2")
    assert refused.status_code == 409
    detail = refused.json()["detail"]
    assert "cap per token is 2" in detail and "EXITPLANE_MAX_RUNTIMES_PER_TOKEN" in detail
    # The other tokens of the deployment still register runtimes, up to the deployment's cap.
    assert [_beat(client, honest, f"pod-{i}").status_code for i in range(2)] == [200, 200]
    third = issue_runtime_token(engine)[1]
    assert _beat(client, third, "pod-2").status_code == 200
    full = _beat(client, issue_runtime_token(engine)[1], "pod-3")
    assert full.status_code == 409 and "the cap is 5" in full.json()["detail"]
    # Known runtimes keep beating whoever sends for them.
    assert _beat(client, leaked, "junk-0", spooled_batches=1).status_code == 200


def test_runtimes_heard_from_once_are_forgotten_quickly(serve, tokens, engine):
    client = serve(max_runtimes_per_token=2, runtime_single_beat_forget_s=600,
                   heartbeat_flush_s=0)
    auth = deploy_for_telemetry(client, tokens, engine)
    assert _beat(client, auth, "probe").status_code == 200  # never heard from again
    assert _beat(client, auth, "steady").status_code == 200
    assert _beat(client, auth, "steady").status_code == 200  # a second beat: a real runtime
    assert _beat(client, auth, "new").status_code == 409
    with Session(engine) as session:  # eleven minutes pass
        for runtime in session.scalars(select(Runtime)):
            runtime.first_seen -= timedelta(minutes=11)
            runtime.last_seen -= timedelta(minutes=11)
        session.commit()
    # The single-beat runtime no longer counts (and is gone); the steady one still does.
    assert _beat(client, auth, "new").status_code == 200
    assert _runtime_ids(engine) == {"steady", "new"}
    assert _beat(client, auth, "another").status_code == 409


def test_operators_remove_runtimes_and_a_removed_one_registers_again(serve, tokens, engine):
    client = serve(max_runtimes_per_token=2)
    peer = serve(max_runtimes_per_token=2)  # another API process on the same store
    auth = deploy_for_telemetry(client, tokens, engine)
    operator = tokens.headers(tokens.operator)
    for runtime_id in ("rt-1", "rt-2"):
        assert _beat(peer, auth, runtime_id).status_code == 200  # the peer has them on record
    assert _beat(client, auth, "rt-3").status_code == 409

    assert client.delete("/v1/deployments/chat/runtimes/rt-1", headers=auth).status_code == 403
    removed = client.delete("/v1/deployments/chat/runtimes/rt-1", headers=operator)
    assert removed.status_code == 200 and removed.json() == {"removed": ["rt-1"]}
    assert client.delete("/v1/deployments/chat/runtimes/rt-1", headers=operator
                         ).status_code == 404
    listed = client.get("/v1/deployments/chat/runtimes", headers=operator).json()
    assert [r["runtime_id"] for r in listed] == ["rt-2"]
    assert _beat(client, auth, "rt-3").status_code == 200  # room again

    # rt-1 comes back through the peer, which had it on record: its beat is held and written
    # in bulk, finds no row, and the peer forgets it, so the next beat registers it again.
    assert client.delete("/v1/deployments/chat/runtimes/rt-3", headers=operator
                         ).status_code == 200
    assert _beat(peer, auth, "rt-1").status_code == 200
    peer.app.state.heartbeats.flush()
    assert _beat(peer, auth, "rt-1").status_code == 200
    peer.app.state.heartbeats.flush()
    assert "rt-1" in _runtime_ids(engine)

    # Every runtime one token registered, at once (a leaked token's, once revoked).
    with Session(engine) as session:
        token_id = session.scalar(select(Runtime.token_id).where(Runtime.runtime_id == "rt-2"))
    swept = client.delete("/v1/deployments/chat/runtimes", headers=operator,
                          params={"token_id": token_id})
    assert swept.status_code == 200 and swept.json() == {"removed": ["rt-1", "rt-2"]}
    assert _runtime_ids(engine) == set()


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_concurrent_first_heartbeats_of_one_runtime_upsert_on_postgresql(engine, tokens,
                                                                         outbox):
    from controlplane.deployments.schemas import DeploymentCreate
    from controlplane.deployments.service import create_deployment

    with Session(engine, expire_on_commit=False) as session:
        deployment = create_deployment(session=session, actor="test", spec=DeploymentCreate(
            name="chat", model_ref="m", num_layers=12, exit_layers=[3, 6, 9]))
        session.commit()
    caps = RuntimeCaps(per_deployment=10, per_token=10)
    # The first beat's transaction inserts and holds its row; the second starts meanwhile.
    first = Session(engine)
    record_heartbeat(session=first, deployment=deployment, caps=caps,
                     beat=Heartbeat(runtime_id="rt-1", spooled_batches=1))
    outcome: dict = {}

    def second_beat() -> None:
        with Session(engine) as second:
            try:
                runtime = record_heartbeat(session=second, deployment=deployment, caps=caps,
                                           beat=Heartbeat(runtime_id="rt-1", spooled_batches=2))
                outcome["spooled"] = runtime.spooled_batches
                second.commit()
            except Exception as error:
                outcome["error"] = error

    thread = threading.Thread(target=second_beat)
    thread.start()
    thread.join(timeout=1.0)
    assert thread.is_alive()  # waiting on the first beat's transaction
    first.commit()
    first.close()
    thread.join(timeout=30)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["spooled"] == 2
    with Session(engine) as session:
        rows = session.scalars(select(Runtime)).all()
    assert [(r.runtime_id, r.spooled_batches) for r in rows] == [("rt-1", 2)]


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_burst_of_first_heartbeats_answers_no_500(app, tokens, engine, live_server):
    client = TestClient(app)
    auth = deploy_for_telemetry(client, tokens, engine)

    def beat(i: int) -> int:
        return httpx.post(live_server.url + BEATS.format("chat"), headers=auth, timeout=30,
                          json={"runtime_id": f"rt-{i % 4}", "spooled_batches": i}).status_code

    with ThreadPoolExecutor(max_workers=16) as pool:
        statuses = list(pool.map(beat, range(64)))
    assert set(statuses) == {200}, statuses
    assert _runtime_ids(engine) == {"rt-0", "rt-1", "rt-2", "rt-3"}
