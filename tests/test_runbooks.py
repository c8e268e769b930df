"""Every Prometheus alert rule (dashboards/prometheus/alerts.yml) has a runbook section in
docs/operations/runbooks.md, and every runbook section is for a rule that exists."""

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_each_alert_rule_has_exactly_one_runbook():
    rules = yaml.safe_load((ROOT / "dashboards" / "prometheus" / "alerts.yml").read_text())
    alerts = [rule["alert"] for group in rules["groups"] for rule in group["rules"]
              if "alert" in rule]
    runbooks = re.findall(r"^## (\w+)\s*$",
                          (ROOT / "docs" / "operations" / "runbooks.md").read_text(), re.M)
    assert len(alerts) >= 7
    assert sorted(runbooks) == sorted(alerts)
