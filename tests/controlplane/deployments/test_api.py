"""The registry over HTTP: publish, activate, pull with ETag, 304, long-poll, rollback, audit."""

import threading
import time

import httpx
import pytest
from sqlalchemy.orm import Session

from controlplane.auth.service import create_token
from controlplane.deployments.service import get_deployment
from exitplane import __version__
from exitplane.wire import ThresholdSetWire
from tests.support.deployments import (
    DEPLOYMENT,
    mint_runtime_token,
    post_deployment,
    tuned_deployment,
)
from tests.support.waiting import patient_get


def test_full_registry_session(client, tokens, engine):
    op = post_deployment(client, tokens)
    created = client.get("/v1/deployments/chat", headers=op).json()
    assert created["aliases"] == {"active": 1, "conservative": 1}

    v2 = client.post("/v1/deployments/chat/threshold-sets", headers=op, json={
        "thresholds": {"3": 0.95, "6": 0.9, "9": 0.85}, "reason": "first calibration by hand"})
    assert v2.status_code == 201, v2.text
    assert v2.json()["version"] == 2 and v2.json()["parent_version"] == 1
    v3 = client.post("/v1/deployments/chat/threshold-sets", headers=op, json={
        "thresholds": {"3": 0.9, "6": 0.8, "9": 0.7}, "reason": "more aggressive",
        "activate": True})
    assert v3.json()["aliases"] == ["active"]

    runtime = {"Authorization": f"Bearer {mint_runtime_token(engine, 'chat')}"}
    pulled = client.get("/v1/deployments/chat/thresholds", params={"runtime_id": "rt-1"},
                        headers=runtime)
    assert pulled.status_code == 200
    wire = ThresholdSetWire.model_validate(pulled.json())
    wire.verify()
    assert wire.version == 3 and pulled.headers["etag"] == f'"{wire.checksum}"'

    again = client.get("/v1/deployments/chat/thresholds", params={"runtime_id": "rt-1"},
                       headers={**runtime, "If-None-Match": pulled.headers["etag"]})
    assert again.status_code == 304 and again.content == b""

    rolled = client.post("/v1/deployments/chat/rollback", headers=op,
                         json={"reason": "quality dropped"})
    assert rolled.status_code == 200, rolled.text
    assert (rolled.json()["from_version"], rolled.json()["to_version"]) == (3, 1)
    time.sleep(0.25)  # the config cache TTL in tests; this process was also told at commit
    after = client.get("/v1/deployments/chat/thresholds", params={"runtime_id": "rt-1"},
                       headers={**runtime, "If-None-Match": pulled.headers["etag"]})
    assert after.status_code == 200 and after.json()["version"] == 1

    audit = patient_get(client, "/v1/deployments/chat/audit", headers=op).json()
    assert audit[0]["action"] == "alias.rollback" and audit[0]["reason"] == "quality dropped"
    assert {e["action"] for e in audit} >= {"deployment.create", "threshold_set.publish",
                                            "alias.move", "alias.rollback"}


@pytest.mark.parametrize(("body", "status", "message"), [
    ({"thresholds": {"3": 0.9, "6": 0.9}, "reason": "r"}, 422, "missing thresholds"),
    ({"thresholds": {"3": 0.9, "6": 0.9, "9": 0.9, "10": 0.9}, "reason": "r"}, 422,
     "unknown exit layers \\[10\\]"),
    ({"thresholds": {"3": 0.9, "6": 0.9, "9": 2}, "reason": "r"}, 422, "layer 9 is 2"),
    ({"thresholds": {"3": "x", "6": 0.9, "9": 0.9}, "reason": "r"}, 422, "thresholds.3"),
    ({"thresholds": {"3": 0.9, "6": 0.9, "9": 0.9}}, 422, "reason"),
])
def test_invalid_threshold_sets_get_422_with_a_message(client, tokens, body, status, message):
    import re

    op = post_deployment(client, tokens)
    response = client.post("/v1/deployments/chat/threshold-sets", headers=op, json=body)
    assert response.status_code == status
    assert re.search(message, response.json()["detail"]), response.json()
    listed = client.get("/v1/deployments/chat/threshold-sets", headers=op).json()
    assert [s["version"] for s in listed] == [1]


def test_invalid_deployment_gets_422(client, tokens):
    op = tokens.headers(tokens.operator)
    response = client.post("/v1/deployments", headers=op,
                           json={**DEPLOYMENT, "exit_layers": [3, 12]})
    assert response.status_code == 422
    assert "exit_layers must lie in [1, 11]" in response.json()["detail"]
    response = client.post("/v1/deployments", headers=op, json={**DEPLOYMENT, "name": "Bad Name"})
    assert response.status_code == 422 and "name" in response.json()["detail"]


def test_auth_scopes_and_deployment_isolation(client, tokens, engine):
    op = post_deployment(client, tokens, "chat")
    post_deployment(client, tokens, "code")
    chat_runtime = {"Authorization": f"Bearer {mint_runtime_token(engine, 'chat')}"}

    assert client.get("/v1/deployments").status_code == 401
    bad = client.get("/v1/deployments", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.json()["detail"] == "unknown API token"
    # A runtime token pulls its own deployment only, and cannot publish or move aliases.
    assert client.get("/v1/deployments/chat/thresholds", params={"runtime_id": "a"},
                      headers=chat_runtime).status_code == 200
    other = client.get("/v1/deployments/code/thresholds", params={"runtime_id": "a"},
                       headers=chat_runtime)
    assert other.status_code == 403 and "another deployment" in other.json()["detail"]
    assert client.get("/v1/deployments/code", headers=chat_runtime).status_code == 403
    publish = client.post("/v1/deployments/chat/threshold-sets", headers=chat_runtime,
                          json={"thresholds": {"3": 1, "6": 1, "9": 1}, "reason": "r"})
    assert publish.status_code == 403 and "operator" in publish.json()["detail"]
    assert client.put("/v1/deployments/chat/aliases/active", headers=chat_runtime,
                      json={"version": 1, "reason": "r"}).status_code == 403
    # Operators cannot manage tokens; admins can, and a revoked token stops working.
    assert client.get("/v1/tokens", headers=op).status_code == 403
    admin = tokens.headers(tokens.admin)
    made = client.post("/v1/tokens", headers=admin,
                       json={"name": "ci", "scope": "runtime", "deployment": "code"})
    assert made.status_code == 201 and made.json()["token"].startswith("ept_")
    fresh = {"Authorization": f"Bearer {made.json()['token']}"}
    assert client.get("/v1/deployments/code", headers=fresh).status_code == 200
    assert client.delete(f"/v1/tokens/{made.json()['id']}", headers=admin).status_code == 200
    revoked = client.get("/v1/deployments/code", headers=fresh)
    assert revoked.status_code == 401 and "revoked" in revoked.json()["detail"]
    assert client.post("/v1/tokens", headers=admin,
                       json={"name": "x", "scope": "runtime"}).status_code == 422
    assert client.get("/v1/deployments/nope", headers=op).status_code == 404


def test_heartbeats_record_applied_version(client, tokens, engine):
    op = post_deployment(client, tokens)
    runtime = {"Authorization": f"Bearer {mint_runtime_token(engine, 'chat')}"}
    beat = client.post("/v1/deployments/chat/heartbeats", headers=runtime,
                       json={"runtime_id": "rt-1", "applied_version": 1, "ready": True})
    assert beat.status_code == 200, beat.text
    client.post("/v1/deployments/chat/heartbeats", headers=runtime,
                json={"runtime_id": "rt-1", "applied_version": 1, "ready": False,
                      "error": "refused set v2: checksum mismatch"})
    fleet = client.get("/v1/deployments/chat/runtimes", headers=op).json()
    assert len(fleet) == 1
    assert fleet[0]["ready"] is False and "checksum mismatch" in fleet[0]["error"]


def test_long_poll_wakes_on_alias_move(live_server, tokens, engine):
    with httpx.Client(base_url=live_server.url, timeout=30) as http:
        op, runtime, etag = tuned_deployment(http, tokens, engine)
        result = {}

        def poll() -> None:
            started = time.monotonic()
            response = http.get("/v1/deployments/chat/thresholds",
                                params={"runtime_id": "r", "wait": 20},
                                headers={**runtime, "If-None-Match": etag})
            result["elapsed"] = time.monotonic() - started
            result["response"] = response

        poller = threading.Thread(target=poll)
        poller.start()
        time.sleep(1.0)
        assert "response" not in result  # still waiting: nothing changed yet
        moved = http.put("/v1/deployments/chat/aliases/active", headers=op,
                         json={"version": 2, "reason": "go"})
        assert moved.status_code == 200
        poller.join(timeout=20)
        response = result["response"]
        assert response.status_code == 200 and response.json()["version"] == 2
        assert result["elapsed"] < 10  # woken by the move, far before the 20 s wait


def test_long_poll_times_out_with_304(live_server, tokens, engine):
    op = tokens.headers(tokens.operator)
    with httpx.Client(base_url=live_server.url, timeout=30) as http:
        http.post("/v1/deployments", json=DEPLOYMENT, headers=op)
        runtime = {"Authorization": f"Bearer {mint_runtime_token(engine, 'chat')}"}
        etag = http.get("/v1/deployments/chat/thresholds", params={"runtime_id": "r"},
                        headers=runtime).headers["etag"]
        response = http.get("/v1/deployments/chat/thresholds",
                            params={"runtime_id": "r", "wait": 1},
                            headers={**runtime, "If-None-Match": etag})
        assert response.status_code == 304


def test_canary_alias_serves_a_sticky_fraction(client, tokens, engine):
    op = post_deployment(client, tokens)
    client.patch("/v1/deployments/chat", headers=op, json={"canary_fraction": 0.5})
    client.post("/v1/deployments/chat/threshold-sets", headers=op, json={
        "thresholds": {"3": 0.9, "6": 0.9, "9": 0.9}, "reason": "candidate"})
    assert client.put("/v1/deployments/chat/aliases/canary", headers=op,
                      json={"version": 2, "reason": "try it"}).status_code == 200
    runtime = {"Authorization": f"Bearer {mint_runtime_token(engine, 'chat')}"}
    time.sleep(0.25)
    seen = {}
    for i in range(40):
        rid = f"rt-{i}"
        seen[rid] = client.get("/v1/deployments/chat/thresholds", params={"runtime_id": rid},
                               headers=runtime).json()["version"]
    assert set(seen.values()) == {1, 2}
    for rid, version in list(seen.items())[:10]:
        assert client.get("/v1/deployments/chat/thresholds", params={"runtime_id": rid},
                          headers=runtime).json()["version"] == version
    stopped = client.delete("/v1/deployments/chat/aliases/canary", headers=op,
                            params={"reason": "enough"})
    assert stopped.status_code == 200


def test_health_and_readiness(client):
    assert client.get("/healthz").json() == {"status": "ok", "version": __version__}
    assert client.get("/readyz").json() == {"status": "ready"}
    assert client.get("/openapi.json").status_code == 200


def test_cached_304_path_still_enforces_deployment_isolation(client, tokens, engine):
    post_deployment(client, tokens, "chat")
    post_deployment(client, tokens, "code")
    chat = {"Authorization": f"Bearer {mint_runtime_token(engine, 'chat')}"}
    code = {"Authorization": f"Bearer {mint_runtime_token(engine, 'code')}"}
    params = {"runtime_id": "rt"}
    etag = client.get("/v1/deployments/chat/thresholds", params=params,
                      headers=chat).headers["etag"]
    client.get("/v1/deployments/code/thresholds", params=params, headers=code)  # warm its token
    assert client.get("/v1/deployments/chat/thresholds", params=params,
                      headers={**chat, "If-None-Match": etag}).status_code == 304
    stolen = client.get("/v1/deployments/chat/thresholds", params=params,
                        headers={**code, "If-None-Match": etag})
    assert stolen.status_code == 403
    anonymous = client.get("/v1/deployments/chat/thresholds", params=params,
                           headers={"If-None-Match": etag})
    assert anonymous.status_code == 401


def test_oversized_body_gets_413(settings, engine, tokens):
    from fastapi.testclient import TestClient

    from exitplane.app import create_app

    small = create_app(settings.model_copy(update={"max_control_body_bytes": 1000}),
                       engine=engine)
    op = tokens.headers(tokens.operator)
    with TestClient(small) as client:
        big = {"thresholds": {"3": 0.9}, "reason": "x" * 5000}
        response = client.post("/v1/deployments", headers=op, json=big)
        assert response.status_code == 413 and "exceeds the limit" in response.json()["detail"]
        small_body = client.post("/v1/deployments", headers=op, json=DEPLOYMENT)
        assert small_body.status_code == 201
    small.state.config_delivery.close()


def test_pull_and_ingest_are_rate_limited_per_token(settings, engine, tokens):
    from fastapi.testclient import TestClient

    from exitplane.app import create_app

    # Refusals answered at once: a held one would see the bucket refilled after it.
    limited = create_app(settings.model_copy(update={"rate_limit_pull_per_s": 1.0,
                                                     "rate_limit_ingest_per_s": 1.0,
                                                     "rate_limit_hold_s": 0}),
                         engine=engine)
    with TestClient(limited) as client:
        post_deployment(client, tokens)
        first = {"Authorization": f"Bearer {mint_runtime_token(engine, 'chat')}"}
        statuses = [client.get("/v1/deployments/chat/thresholds", params={"runtime_id": "a"},
                               headers=first).status_code for _ in range(4)]
        assert statuses[:2] == [200, 200] and statuses[-1] == 429
        refused = client.get("/v1/deployments/chat/thresholds", params={"runtime_id": "a"},
                             headers=first)
        assert int(refused.headers["retry-after"]) >= 1
        assert "too many pull requests" in refused.json()["detail"]
        # Another token has its own bucket.
        with Session(engine) as session:
            _, other = create_token(session=session, name="rt-2", scope="runtime",
                                    deployment=get_deployment(session=session, name="chat"))
            session.commit()
        assert client.get("/v1/deployments/chat/thresholds", params={"runtime_id": "b"},
                          headers={"Authorization": f"Bearer {other}"}).status_code == 200
        batch = {"batch_id": "b" * 16, "deployment": "chat", "runtime_id": "a", "seq": 0,
                 "num_layers": 12, "records": [{"threshold_version": 1, "request_id": "r",
                                                "position": 0, "exit_layer": 12,
                                                "signal_value": 0.5, "latency_us": 1,
                                                "ts": time.time()}]}
        codes = [client.post("/v1/telemetry", json=batch, headers=first).status_code
                 for _ in range(4)]
        assert codes[:2] == [202, 202] and codes[-1] == 429
    limited.state.config_delivery.close()


def test_numbers_beyond_the_store_get_422_not_500(client, tokens, engine):
    op = post_deployment(client, tokens)
    runtime = {"Authorization": f"Bearer {mint_runtime_token(engine, 'chat')}"}
    beat = client.post("/v1/deployments/chat/heartbeats", headers=runtime,
                       json={"runtime_id": "r", "dropped_records": 10524813163201822696})
    assert beat.status_code == 422 and "dropped_records" in beat.json()["detail"]
    move = client.put("/v1/deployments/chat/aliases/active", headers=op,
                      json={"version": 2**70, "reason": "r"})
    assert move.status_code == 422 and move.json()["detail"]


def test_a_state_serialises_each_set_once(client, app, tokens, engine):
    op = post_deployment(client, tokens)
    client.post("/v1/deployments/chat/threshold-sets", headers=op, json={
        "thresholds": {"3": 0.9, "6": 0.9, "9": 0.9}, "reason": "candidate"})
    assert client.put("/v1/deployments/chat/aliases/canary", headers=op,
                      json={"version": 2, "reason": "try it"}).status_code == 200
    state = app.state.config_delivery.load("chat")
    for wire in (state.active, state.canary):
        body = state.body(wire)
        assert state.body(wire) is body  # the same string for every waiting poll
        assert ThresholdSetWire.model_validate_json(body) == wire
    runtime = {"Authorization": f"Bearer {mint_runtime_token(engine, 'chat')}"}
    pulled = client.get("/v1/deployments/chat/thresholds", params={"runtime_id": "rt-1"},
                        headers=runtime)
    assert pulled.text in (state.active_json, state.canary_json)


def test_unknown_request_fields_are_ignored_within_v1(client, tokens):
    """A newer client's extra fields do not break an older server (docs/protocol.md): create,
    update, publish, alias moves and token creation take them, ignore them and name them in
    the Exitplane-Ignored-Fields header."""
    op = tokens.headers(tokens.operator)
    created = client.post("/v1/deployments", headers=op,
                          json={**DEPLOYMENT, "added_in_a_later_release": {"x": 1}})
    assert created.status_code == 201, created.text
    assert "added_in_a_later_release" not in created.json()
    assert created.headers["exitplane-ignored-fields"] == "added_in_a_later_release"
    patched = client.patch("/v1/deployments/chat", headers=op,
                           json={"delta": 0.04, "future_knob": True})
    assert patched.status_code == 200 and patched.json()["delta"] == 0.04
    assert patched.headers["exitplane-ignored-fields"] == "future_knob"
    published = client.post("/v1/deployments/chat/threshold-sets", headers=op, json={
        "thresholds": {"3": 0.95, "6": 0.9, "9": 0.85}, "reason": "by hand", "note": "new"})
    assert published.status_code == 201, published.text
    moved = client.put("/v1/deployments/chat/aliases/active", headers=op,
                       json={"version": 2, "reason": "ship it", "ticket": "OPS-1"})
    assert moved.status_code == 200, moved.text
    made = client.post("/v1/tokens", headers=tokens.headers(tokens.admin),
                       json={"name": "ci", "scope": "runtime", "deployment": "chat",
                             "expires_in_days_v2": 3})
    assert made.status_code == 201, made.text
    assert made.headers["exitplane-ignored-fields"] == "expires_in_days_v2"
    plain = client.patch("/v1/deployments/chat", headers=op, json={"delta": 0.05})
    assert "exitplane-ignored-fields" not in plain.headers
    # Known fields are still checked.
    assert client.patch("/v1/deployments/chat", headers=op,
                        json={"delta": 7}).status_code == 422
