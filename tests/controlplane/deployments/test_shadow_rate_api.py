"""The shadow-rate fields of the deployments API: bounds on create and update (checked against
each other, 422 otherwise), a fixed rate applied at once, the decided rate and its reason on
read, each bounds change in the audit log."""

from __future__ import annotations

from tests.support.deployments import DEPLOYMENT


def test_bounds_are_set_checked_and_a_fixed_rate_applies_at_once(client, tokens):
    op = tokens.headers(tokens.operator)
    created = client.post("/v1/deployments", headers=op, json=DEPLOYMENT)
    assert created.status_code == 201
    read = created.json()
    assert (read["shadow_rate_min"], read["shadow_rate_max"]) == (0.01, 0.2)
    assert (read["shadow_rate"], read["shadow_rate_reason"], read["shadow_rate_decided_at"]) \
        == (None, "", None)  # runtimes apply their own until the workers decide
    fixed = client.post("/v1/deployments", headers=op, json={
        **DEPLOYMENT, "name": "fixed", "shadow_rate_min": 0.1, "shadow_rate_max": 0.1}).json()
    assert (fixed["shadow_rate"], fixed["shadow_rate_reason"]) == (
        0.1, "fixed by the operator at 0.1")
    assert fixed["shadow_rate_decided_at"] is not None
    crossed = client.post("/v1/deployments", headers=op, json={
        **DEPLOYMENT, "name": "crossed", "shadow_rate_min": 0.3, "shadow_rate_max": 0.1})
    assert crossed.status_code == 422 and "must not exceed" in crossed.text
    refused = client.patch("/v1/deployments/chat", headers=op, json={"shadow_rate_min": 0.5})
    assert refused.status_code == 422 and "must not exceed shadow_rate_max (0.2)" in refused.text
    assert client.patch("/v1/deployments/chat", headers=op, json={
        "shadow_rate_max": 1.5}).status_code == 422
    moved = client.patch("/v1/deployments/chat", headers=op, json={
        "shadow_rate_min": 0.05, "shadow_rate_max": 0.05}).json()
    assert moved["shadow_rate"] == 0.05
    audit = client.get("/v1/deployments/chat/audit", headers=op).json()
    update = next(event for event in audit if event["action"] == "deployment.update")
    assert update["details"]["after"] == {"shadow_rate_min": 0.05, "shadow_rate_max": 0.05}
