"""A deployment's answer target and shadow-request rate: set at creation, changed and turned
off by PATCH (an explicit null clears either, an omitted field leaves it), refused out of
range with a message, and recorded in the audit log."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.deployments.models import AuditEvent
from tests.support.deployments import post_deployment


def test_created_changed_and_cleared_over_the_api(client, tokens, engine):
    operator = post_deployment(client, tokens)
    path = "/v1/deployments/chat"
    body = client.get(path, headers=operator).json()
    assert body["delta_answer"] is None and body["shadow_request_rate"] is None
    changed = client.patch(path, json={"delta_answer": 0.05, "shadow_request_rate": 0.02},
                           headers=operator)
    assert changed.status_code == 200, changed.text
    assert (changed.json()["delta_answer"], changed.json()["shadow_request_rate"]) == (0.05, 0.02)
    # an omitted field is left as it is; an explicit null turns it off
    kept = client.patch(path, json={"delta": 0.02}, headers=operator).json()
    assert (kept["delta_answer"], kept["shadow_request_rate"]) == (0.05, 0.02)
    cleared = client.patch(path, json={"delta_answer": None}, headers=operator).json()
    assert cleared["delta_answer"] is None and cleared["shadow_request_rate"] == 0.02
    with Session(engine) as session:
        details = [event.details for event in session.scalars(select(AuditEvent).where(
            AuditEvent.action == "deployment.update").order_by(AuditEvent.id))]
    assert details[-1] == {"before": {"delta_answer": 0.05}, "after": {"delta_answer": None}}


def test_created_with_them(client, tokens):
    operator = tokens.headers(tokens.operator)
    made = client.post("/v1/deployments", json={
        "name": "answers", "model_ref": "tiny", "num_layers": 12, "exit_layers": [3, 6, 9],
        "delta_answer": 0.1, "shadow_request_rate": 0.05}, headers=operator)
    assert made.status_code == 201, made.text
    assert made.json()["delta_answer"] == 0.1 and made.json()["shadow_request_rate"] == 0.05


def test_out_of_range_values_are_refused_with_a_message(client, tokens):
    operator = post_deployment(client, tokens)
    for body, field in (({"delta_answer": 0}, "delta_answer"),
                        ({"delta_answer": 1.0}, "delta_answer"),
                        ({"shadow_request_rate": 1.5}, "shadow_request_rate"),
                        ({"shadow_request_rate": -0.1}, "shadow_request_rate")):
        refused = client.patch("/v1/deployments/chat", json=body, headers=operator)
        assert refused.status_code == 422 and field in refused.text
    assert client.post("/v1/deployments", json={
        "name": "bad", "model_ref": "tiny", "num_layers": 12, "delta_answer": 2},
        headers=operator).status_code == 422
