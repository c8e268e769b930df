"""The admin UI's audit page: the fleet-wide log, newest first, for admins only, filtered by
its GET form, paged by the log's cursor, and linked from the navigation."""

from __future__ import annotations

import html
import re

from sqlalchemy.orm import Session

from controlplane.auth.audit import record_admin_event
from controlplane.deployments import service as thresholds
from controlplane.deployments.schemas import DeploymentCreate
from dashboards.views.audit import PAGE

ROW = re.compile(r"<tr>\s*<th scope=\"row\">.*?</tr>", re.S)


def _seed(engine, extra_tokens: int = 0) -> None:
    with Session(engine) as session:
        deployment = thresholds.create_deployment(session=session, spec=DeploymentCreate(
            name="chat", model_ref="m", num_layers=12, exit_layers=[3, 6, 9]),
            actor="user:ann")
        published = thresholds.publish(session=session, deployment=deployment,
                                       thresholds={3: 0.95, 6: 0.9, 9: 0.8},
                                       reason="tighter <b>exits</b>", actor="user:ann")
        thresholds.rollback(session=session, deployment=deployment, actor="user:ann",
                            reason="too eager", to_version=published.version)
        for number in range(extra_tokens):
            record_admin_event(session=session, actor="user:root", action="token.create",
                               target=f"token:{number}")
        session.commit()


def _rows(page: str) -> list[str]:
    return ROW.findall(page)


def test_admins_read_the_fleet_log_and_filter_it(engine, as_role):
    _seed(engine)
    browser = as_role("admin")
    page = browser.get("/ui/audit")
    assert page.status_code == 200
    assert 'href="/ui/audit" aria-current="page">Audit</a>' in page.text  # in the nav
    rows = _rows(page.text)
    assert "alias.rollback" in rows[0] and "too eager" in rows[0]
    assert any("threshold_set.publish" in row and "chat/v2" in row for row in rows)
    assert "tighter &lt;b&gt;exits&lt;/b&gt;" in page.text  # reasons are text, not markup
    assert any("user.create" in row and "user admin" in row and "local" in row
               for row in rows)  # the people fixture made the users from the store

    only = browser.get("/ui/audit", params={"action": "alias.*", "deployment": "chat"})
    actions = [re.search(r"<code>([^<]+)</code>", row).group(1) for row in _rows(only.text)]
    assert actions == ["alias.rollback", "alias.move", "alias.move"]
    nobody = browser.get("/ui/audit", params={"actor": "system:*"})
    assert "No events match." in nobody.text

    wrong = browser.get("/ui/audit", params={"since": "yesterday"})
    assert wrong.status_code == 422
    assert "not a time like" in html.unescape(wrong.text)
    garbled = browser.get("/ui/audit", params={"cursor": "%%%"})
    assert garbled.status_code == 422 and "cursor" in garbled.text


def test_the_page_goes_back_through_older_events(engine, as_role):
    _seed(engine, extra_tokens=PAGE + 5)
    browser = as_role("admin")
    first = browser.get("/ui/audit", params={"action": "token.*"})
    assert len(_rows(first.text)) == PAGE
    older = re.search(r'rel="next" href="([^"]+)"', first.text)
    assert older, "a full page links to the older events"
    second = browser.get(html.unescape(older.group(1)))
    assert second.status_code == 200
    seen = {re.search(r"token (\d+)", row).group(1)
            for row in _rows(first.text) + _rows(second.text) if re.search(r"token (\d+)", row)}
    assert seen == {str(n) for n in range(PAGE + 5)}  # the people fixture's aren't token.*
    assert 'rel="next"' not in second.text
    assert "action=token.%2A" in html.unescape(older.group(1))  # the filter is kept


def test_only_admins_see_the_page_and_its_link(engine, as_role):
    _seed(engine)
    for role in ("viewer", "operator"):
        browser = as_role(role)
        assert browser.get("/ui/audit").status_code == 403
        assert 'href="/ui/audit"' not in browser.get("/ui/").text
        browser.post("/ui/logout", data={"csrf_token": re.search(
            r'name="csrf_token" value="([^"]+)"', browser.get("/ui/").text).group(1)})
