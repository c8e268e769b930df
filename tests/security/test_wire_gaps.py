"""What a runtime author gets wrong is refused with a 422 (or 415) that says what: a shadow
token that did not run to full depth (a shadow point at its own exit layer), a non-boolean
`matched`, a body that is not JSON on a JSON route, a heartbeat naming a version that was
never published. Every error body has one shape: `detail`, a string, and for a request that
does not validate `errors` with JSON locations (never Python reprs)."""

from __future__ import annotations

import time

import pytest
from sqlalchemy.orm import Session

from controlplane.auth.service import create_token
from controlplane.deployments.service import get_deployment
from tests.support.batches import telemetry_batch

NUM_LAYERS = 6
EXIT_LAYERS = [2, 4]


@pytest.fixture
def runtime(client, tokens, engine) -> dict[str, str]:
    """Deployment `tiny` (exit layers 2 and 4, version 1 published); a runtime token's
    headers for it."""
    operator = tokens.headers(tokens.operator)
    created = client.post("/v1/deployments", headers=operator, json={
        "name": "tiny", "model_ref": "tiny-llama", "num_layers": NUM_LAYERS,
        "exit_layers": EXIT_LAYERS, "signal": "maxprob"})
    assert created.status_code == 201, created.text
    published = client.post("/v1/deployments/tiny/threshold-sets", headers=operator, json={
        "thresholds": {"2": 0.9, "4": 0.8}, "reason": "test", "activate": True})
    assert published.status_code == 201, published.text
    with Session(engine) as session:
        _, secret = create_token(session=session, name="rt", scope="runtime",
                                 deployment=get_deployment(session=session, name="tiny"))
        session.commit()
    return tokens.headers(secret)


def _batch(*records: dict) -> dict:
    return telemetry_batch(list(records), deployment="tiny", seq=1, num_layers=NUM_LAYERS)


def _shadow(exit_layer: int = NUM_LAYERS, matched=True) -> dict:
    return {"threshold_version": 1, "request_id": "r", "position": 0, "exit_layer": exit_layer,
            "signal_value": 0.7, "latency_us": 10, "ts": time.time(),
            "shadow": [{"layer": k, "signal": 0.7, "matched": matched} for k in EXIT_LAYERS]}


def _one_shape(answer) -> dict:
    body = answer.json()
    assert isinstance(body["detail"], str) and body["detail"]
    for error in body.get("errors", []):
        assert isinstance(error["loc"], list), error
        assert all(isinstance(part, str | int) for part in error["loc"]), error
        assert "(" not in str(error["loc"]), error
    return body


def test_a_full_depth_shadow_token_is_taken(client, runtime):
    answer = client.post("/v1/telemetry", headers=runtime, json=_batch(_shadow()))
    assert answer.status_code == 202, answer.text


def test_a_shadow_point_at_the_tokens_own_exit_layer_is_refused(client, runtime):
    answer = client.post("/v1/telemetry", headers=runtime, json=_batch(_shadow(exit_layer=2)))
    assert answer.status_code == 422, answer.text
    body = _one_shape(answer)
    assert "shadow token runs to full depth" in body["detail"]
    assert body["index"] == 0


@pytest.mark.parametrize("matched", ["yes", "true", 1, 0, None])
def test_matched_is_a_json_boolean(client, runtime, matched):
    answer = client.post("/v1/telemetry", headers=runtime, json=_batch(_shadow(matched=matched)))
    assert answer.status_code == 422, answer.text
    body = _one_shape(answer)
    assert "matched" in body["detail"] and "boolean" in body["detail"]


def test_a_heartbeat_ready_flag_is_a_json_boolean(client, runtime):
    answer = client.post("/v1/deployments/tiny/heartbeats", headers=runtime,
                         json={"runtime_id": "rt-1", "ready": "yes"})
    assert answer.status_code == 422, answer.text
    body = _one_shape(answer)
    assert body["errors"][0]["loc"] == ["body", "ready"]
    assert body["detail"].startswith("body.ready")


def test_a_heartbeat_naming_a_version_never_published_is_refused(client, runtime):
    for version in (0, 1):  # the built-in never-exit set, and the published one
        answer = client.post("/v1/deployments/tiny/heartbeats", headers=runtime,
                             json={"runtime_id": "rt-1", "applied_version": version})
        assert answer.status_code == 200, answer.text
    answer = client.post("/v1/deployments/tiny/heartbeats", headers=runtime,
                         json={"runtime_id": "rt-1", "applied_version": 7})
    assert answer.status_code == 422, answer.text
    assert "applied_version 7 was never published for 'tiny'" in _one_shape(answer)["detail"]
    listed = client.get("/v1/deployments/tiny/runtimes", headers=runtime)
    # the refused beat changed nothing: the runtime still reports version 1
    if listed.status_code == 200:
        assert [r["applied_version"] for r in listed.json()] == [1]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          None])
def test_json_routes_refuse_other_bodies_with_415(client, runtime, tokens, content_type):
    headers = {**runtime, **({"Content-Type": content_type} if content_type else {})}
    beat = client.post("/v1/deployments/tiny/heartbeats", headers=headers,
                       content=b'{"runtime_id": "rt-1"}')
    assert beat.status_code == 415, beat.text
    assert "application/json" in _one_shape(beat)["detail"]
    operator = {**tokens.headers(tokens.operator),
                **({"Content-Type": content_type} if content_type else {})}
    created = client.post("/v1/deployments", headers=operator,
                          content=b'{"name": "x", "model_ref": "m", "num_layers": 6}')
    assert created.status_code == 415, created.text


def test_json_with_a_charset_or_a_json_suffix_is_taken(client, runtime):
    for content_type in ("application/json; charset=utf-8", "application/merge-patch+json"):
        answer = client.post("/v1/deployments/tiny/heartbeats",
                             headers={**runtime, "Content-Type": content_type},
                             content=b'{"runtime_id": "rt-1"}')
        assert answer.status_code == 200, (content_type, answer.text)


def test_a_request_that_does_not_validate_names_json_locations(client, tokens):
    answer = client.post("/v1/deployments", headers=tokens.headers(tokens.operator),
                         json={"name": "x", "model_ref": "m", "num_layers": "many"})
    assert answer.status_code == 422, answer.text
    body = _one_shape(answer)
    assert ["body", "num_layers"] in [error["loc"] for error in body["errors"]]
    assert body["detail"].startswith("body.num_layers")
