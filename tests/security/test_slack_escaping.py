"""Slack escaping: text that users and runtimes control (deployment names,
alert summaries, resolutions) cannot ping a channel, forge a link or break the message:
`&`, `<` and `>` are escaped in every Slack text field."""

from __future__ import annotations

import json

from controlplane.alerts import hooks
from controlplane.alerts.hooks import HookTarget

HOSTILE = "<!channel> pay <https://evil.example/login|exitplane login> & <@U123>"


def _alert(**overrides) -> dict:
    alert = {"id": 7, "deployment": "chat<!here>", "kind": "quality_regression",
             "layer": 8, "severity": "critical", "status": "resolved",
             "dedup_key": "chat:quality_regression:8", "summary": HOSTILE, "evidence": {},
             "action_taken": "fallback <!everyone>", "fired_at": "2026-11-30T09:00:00Z",
             "acknowledged_at": None, "acknowledged_by": None,
             "resolved_at": "2026-11-30T09:10:00Z", "resolved_by": "user:<!subteam^S1>",
             "resolution": "fixed & <b>done</b>",
             "url": "http://exitplane.test/ui/alerts/7", "report_url": None}
    return alert | overrides


def _texts(payload: dict) -> list[str]:
    return [payload["text"], payload["blocks"][0]["text"]["text"],
            payload["blocks"][1]["elements"][0]["text"]]


def test_slack_text_is_escaped():
    hook = HookTarget(kind="slack", url="https://hooks.slack.com/services/T/B/X")
    payload = json.loads(hooks.build_request(hook=hook, alert=_alert(), event="resolved").body)
    text, section, links = _texts(payload)
    for field in (text, section):
        assert "<!" not in field and "<@" not in field and "<https://evil" not in field
        assert "&lt;!channel&gt; pay &lt;https://evil.example/login|exitplane login&gt; " \
               "&amp; &lt;@U123&gt;" in field
    assert "chat&lt;!here&gt;" in text
    assert "fallback &lt;!everyone&gt;" in section
    assert "resolved by user:&lt;!subteam^S1&gt;: fixed &amp; &lt;b&gt;done&lt;/b&gt;" in section
    # Our own link stays a link.
    assert links == "<http://exitplane.test/ui/alerts/7|open in exitplane>"


def test_a_link_cannot_be_closed_early():
    hook = HookTarget(kind="slack", url="https://hooks.slack.com/services/T/B/X")
    alert = _alert(url="http://exitplane.test/ui/alerts/7|click here><!channel")
    links = _texts(json.loads(hooks.build_request(hook=hook, alert=alert,
                                                  event="firing").body))[2]
    assert links.count("<") == 1 and links.count(">") == 1 and "<!channel" not in links
