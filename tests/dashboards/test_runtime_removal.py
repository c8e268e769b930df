"""Operators remove a runtime from the deployment page: a Remove link on each runtime's row, a
confirmation page saying what removal does, and a CSRF-checked form that asks for a reason (in
the audit log). Viewers see no link and are refused; the runtime registers anew if it beats."""

from __future__ import annotations

import re

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.deployments.models import AuditEvent
from controlplane.runtimes.models import Runtime
from tests.support.people import csrf_of

REMOVE = "/ui/deployments/chat/runtimes/rt-a/remove"


def _runtime_ids(engine) -> list[str]:
    with Session(engine) as session:
        return sorted(session.scalars(select(Runtime.runtime_id)))


def _removals(engine) -> list[AuditEvent]:
    with Session(engine) as session:
        return list(session.scalars(select(AuditEvent).where(
            AuditEvent.action == "runtime.remove")))


def test_an_operator_removes_a_runtime_after_confirming(as_role, seeded, engine):
    client = as_role("operator")
    page = client.get("/ui/deployments/chat").text
    assert f'href="{REMOVE}"' in page
    assert 'href="/ui/deployments/chat/runtimes/rt-b/remove"' in page

    confirm = client.get(REMOVE)
    assert confirm.status_code == 200
    assert "Remove runtime <code>rt-a</code>" in confirm.text
    assert "registers anew" in confirm.text
    assert re.search(rf'<form method="post" action="{REMOVE}"', confirm.text)
    assert _runtime_ids(engine) == ["rt-a", "rt-b"]  # showing the page removes nothing

    done = client.post(REMOVE, data={"reason": "host decommissioned",
                                     "csrf_token": csrf_of(confirm.text)})
    assert done.status_code == 200  # followed to the deployment page
    assert "Runtime rt-a removed" in done.text
    assert f'href="{REMOVE}"' not in done.text
    assert _runtime_ids(engine) == ["rt-b"]
    [event] = _removals(engine)
    assert (event.actor, event.reason, event.details) == (
        "user:operator", "host decommissioned", {"runtime_id": "rt-a"})
    assert client.get("/v1/deployments/chat/runtimes").status_code == 401  # the API needs a token


def test_removal_needs_a_reason_and_csrf(as_role, seeded, engine):
    client = as_role("admin")
    token = csrf_of(client.get(REMOVE).text)
    no_reason = client.post(REMOVE, data={"reason": "  ", "csrf_token": token})
    assert "give a reason" in no_reason.text
    forged = client.post(REMOVE, data={"reason": "x", "csrf_token": "forged"},
                         follow_redirects=False)
    assert forged.status_code == 403
    assert _runtime_ids(engine) == ["rt-a", "rt-b"] and _removals(engine) == []


def test_viewers_see_no_remove_link_and_are_refused(as_role, seeded, engine):
    client = as_role("viewer")
    page = client.get("/ui/deployments/chat").text
    assert "/runtimes/rt-a/remove" not in page and "Remove…" not in page
    assert client.get(REMOVE).status_code == 403
    refused = client.post(REMOVE, data={"reason": "x", "csrf_token": csrf_of(page)},
                          follow_redirects=False)
    assert refused.status_code == 403 and "needs the operator role" in refused.text
    assert _runtime_ids(engine) == ["rt-a", "rt-b"]


def test_an_unknown_runtime_is_named(as_role, seeded, engine):
    client = as_role("operator")
    assert client.get("/ui/deployments/chat/runtimes/rt-zz/remove").status_code == 404
    token = csrf_of(client.get(REMOVE).text)
    answer = client.post("/ui/deployments/chat/runtimes/rt-zz/remove",
                         data={"reason": "gone", "csrf_token": token})
    assert "has no runtime &#39;rt-zz&#39;" in answer.text
    assert _runtime_ids(engine) == ["rt-a", "rt-b"] and _removals(engine) == []
