"""Every Prometheus alert rule (dashboards/prometheus/alerts.yml) has a runbook section in
docs/operations/runbooks.md and a `runbook_url` annotation pointing at that section, and every
runbook section is for a rule that exists."""

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RUNBOOKS = ROOT / "docs" / "operations" / "runbooks.md"
URL = "{{ $externalLabels.exitplane_docs_url }}/operations/runbooks/#"


def _rules() -> list[dict]:
    rules = yaml.safe_load((ROOT / "dashboards" / "prometheus" / "alerts.yml").read_text())
    return [rule for group in rules["groups"] for rule in group["rules"] if "alert" in rule]


def test_each_alert_rule_has_exactly_one_runbook():
    alerts = [rule["alert"] for rule in _rules()]
    runbooks = re.findall(r"^## (\w+)\s*$", RUNBOOKS.read_text(), re.M)
    assert len(alerts) >= 15
    assert sorted(runbooks) == sorted(alerts)


def test_each_rule_links_its_runbook_section():
    """runbook_url ends in the anchor mkdocs gives the rule's heading (the lower-cased name)."""
    from markdown import Markdown

    html = Markdown(extensions=["toc"]).convert(RUNBOOKS.read_text())
    anchors = set(re.findall(r'<h2 id="([^"]+)"', html))
    for rule in _rules():
        url = rule["annotations"].get("runbook_url", "")
        assert url.startswith(URL), (rule["alert"], url)
        anchor = url.removeprefix(URL)
        assert anchor in anchors, (rule["alert"], anchor)
        assert anchor == rule["alert"].lower()
