"""A token's deployment is a runtime token's alone: an operator or admin token naming one is
refused (422) over the API and in the service, since they reach every deployment and deleting
one would take them with it. A runtime token's creation and revocation are audit events of its
deployment, by name, so the fleet log filtered by that deployment (`exitplane audit
--deployment`) lists them; other tokens' events name none."""

from __future__ import annotations

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.auth.models import AdminEvent, ApiToken
from controlplane.auth.service import create_token, revoke_token
from controlplane.deployments.audit import AuditFilter, fleet_audit
from controlplane.deployments.service import get_deployment
from controlplane.errors import Invalid
from tests.support.alerts import make_deployment


@pytest.fixture
def chat(engine) -> None:
    with Session(engine) as session:
        make_deployment(session, "chat")
        session.commit()


@pytest.mark.parametrize("scope", ["operator", "admin"])
def test_the_api_refuses_a_deployment_on_an_operator_or_admin_token(client, tokens, engine,
                                                                    chat, scope):
    admin = tokens.headers(tokens.admin)
    refused = client.post("/v1/tokens", headers=admin,
                          json={"name": "ops", "scope": scope, "deployment": "chat"})
    assert refused.status_code == 422, refused.text
    assert "only a runtime token serves one deployment" in refused.text
    assert "leave the deployment out" in refused.text
    with Session(engine) as session:
        assert session.scalars(select(ApiToken).where(ApiToken.name == "ops")).all() == []
    made = client.post("/v1/tokens", headers=admin, json={"name": "ops", "scope": scope})
    assert made.status_code == 201 and made.json()["deployment"] is None
    runtime = client.post("/v1/tokens", headers=admin,
                          json={"name": "rt", "scope": "runtime", "deployment": "chat"})
    assert runtime.status_code == 201 and runtime.json()["deployment"] == "chat"


@pytest.mark.parametrize("scope", ["operator", "admin"])
def test_the_service_refuses_a_deployment_on_an_operator_or_admin_token(session, chat, scope):
    deployment = get_deployment(session=session, name="chat")
    with pytest.raises(Invalid, match=f"an {scope} token reaches every deployment"):
        create_token(session=session, name="ops", scope=scope, deployment=deployment)


def test_runtime_token_events_name_their_deployment(session, chat):
    deployment = get_deployment(session=session, name="chat")
    runtime, _ = create_token(session=session, name="rt", scope="runtime",
                              deployment=deployment, actor="user:ann", reason="edge site")
    operator, _ = create_token(session=session, name="ops", scope="operator",
                               actor="user:ann")
    revoke_token(session=session, token_id=runtime.id, actor="user:ann", reason="site closed")
    revoke_token(session=session, token_id=operator.id, actor="user:ann")
    session.commit()
    stored = {(event.action, event.target): event.deployment
              for event in session.scalars(select(AdminEvent))}
    assert stored == {("token.create", f"token:{runtime.id}"): "chat",
                      ("token.revoke", f"token:{runtime.id}"): "chat",
                      ("token.create", f"token:{operator.id}"): None,
                      ("token.revoke", f"token:{operator.id}"): None}
    listed = fleet_audit(session=session, rules=AuditFilter(deployment="chat", action="token.*"))
    assert sorted((event.action, event.target) for event in listed) == [
        ("token.create", f"token:{runtime.id}"), ("token.revoke", f"token:{runtime.id}")]
