"""Deployments made through the API as an operator makes them, and the tokens that act on them:
a runtime token minted for a deployment, a deployment tuned for telemetry (versions 1 and 2,
exits at layers 3, 6 and 9 of 12), one with per-segment thresholds."""

from __future__ import annotations

import uuid

import httpx
from sqlalchemy.orm import Session

from controlplane.auth.service import create_token
from controlplane.deployments.service import get_deployment

LAYERS = [3, 6, 9]
FULL = 12
DEPLOYMENT = {"name": "chat", "model_ref": "smollm2-135m", "num_layers": FULL,
              "exit_layers": LAYERS}
THRESHOLDS = {"3": 0.9, "6": 0.8, "9": 0.7}
CODE_THRESHOLDS = {"3": 0.1, "6": 0.1, "9": 0.1}  # code exits early: its own, far lower ones
SEGMENTS = ("default", "chat", "code")


def _create_runtime_token(engine, deployment: str, name: str) -> tuple[int, str]:
    with Session(engine) as session:
        target = get_deployment(session=session, name=deployment)
        token, secret = create_token(session=session, name=name, scope="runtime",
                                     deployment=target)
        session.commit()
        return token.id, secret


def mint_runtime_token(engine, deployment: str) -> str:
    """A runtime token (named rt-<deployment>) for deployment `deployment`; its secret."""
    return _create_runtime_token(engine, deployment, f"rt-{deployment}")[1]


def issue_runtime_token(engine, deployment: str = "chat", *,
                        name: str | None = None) -> tuple[int, dict[str, str]]:
    """Another runtime token for `deployment`, named `name` (else a name of its own): its id
    and the Authorization header that carries it."""
    token_id, secret = _create_runtime_token(engine, deployment,
                                             name or f"rt-{uuid.uuid4().hex[:12]}")
    return token_id, {"Authorization": f"Bearer {secret}"}


def runtime_headers(engine, deployment: str) -> dict[str, str]:
    """The Authorization header of a runtime token minted for `deployment`."""
    return {"Authorization": f"Bearer {mint_runtime_token(engine, deployment)}"}


def post_deployment(client, tokens, name: str = "chat") -> dict[str, str]:
    """DEPLOYMENT created as `name` by the operator; the operator's headers."""
    op = tokens.headers(tokens.operator)
    response = client.post("/v1/deployments", json={**DEPLOYMENT, "name": name}, headers=op)
    assert response.status_code == 201, response.text
    return op


def tuned_deployment(http: httpx.Client, tokens, engine, runtime_id: str = "r"):
    """'chat' with a second, inactive set (v2) and a runtime token that pulled once: the
    operator's headers, the runtime's headers and the ETag it holds."""
    op = tokens.headers(tokens.operator)
    assert http.post("/v1/deployments", json=DEPLOYMENT, headers=op).status_code == 201
    http.post("/v1/deployments/chat/threshold-sets", headers=op, json={
        "thresholds": {"3": 0.9, "6": 0.9, "9": 0.9}, "reason": "tuned"})
    runtime = runtime_headers(engine, "chat")
    first = http.get("/v1/deployments/chat/thresholds", params={"runtime_id": runtime_id},
                     headers=runtime)
    return op, runtime, first.headers["etag"]


def deploy_for_telemetry(client, tokens, engine, name: str = "chat") -> dict[str, str]:
    """Deployment `name` (exits at LAYERS of FULL) with THRESHOLDS active as version 2; the
    headers of a runtime token for it."""
    op = tokens.headers(tokens.operator)
    assert client.post("/v1/deployments", headers=op, json={
        "name": name, "model_ref": "tiny", "num_layers": FULL,
        "exit_layers": LAYERS}).status_code == 201
    client.post(f"/v1/deployments/{name}/threshold-sets", headers=op, json={
        "thresholds": THRESHOLDS, "reason": "tuned", "activate": True})
    return runtime_headers(engine, name)


def deploy_with_segments(client, tokens, engine, name: str = "mix", declare=("chat",),
                         auto: bool = False) -> dict[str, str]:
    """A deployment whose version 2 gives `code` a map of its own (declaring `code`), with the
    segments `declare` declared; `auto`: it registers names from telemetry. The headers of a
    runtime token for it."""
    op = tokens.headers(tokens.operator)
    assert client.post("/v1/deployments", headers=op, json={
        "name": name, "model_ref": "tiny", "num_layers": FULL, "auto_segments": auto,
        "exit_layers": LAYERS}).status_code == 201
    for segment in declare:
        declared = client.put(f"/v1/deployments/{name}/declared-segments/{segment}", headers=op)
        assert declared.status_code == 200, declared.text
    published = client.post(f"/v1/deployments/{name}/threshold-sets", headers=op, json={
        "thresholds": THRESHOLDS, "segments": {"code": CODE_THRESHOLDS},
        "reason": "per segment", "activate": True})
    assert published.status_code == 201, published.text
    assert published.json()["version"] == 2
    return runtime_headers(engine, name)
