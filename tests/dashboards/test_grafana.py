"""The Grafana dashboard stays in step with the control plane's Prometheus metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import Counter, Gauge, Histogram

from controlplane import metrics
from controlplane.alerts.exporter import store_collector

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "grafana" / "exitplane.json"


def _exposed_names() -> dict[str, str]:
    """Exposed series name -> the metric it belongs to (counters gain `_total`)."""
    names = {}
    for value in vars(metrics).values():
        if isinstance(value, Counter):
            names[f"{value._name}_total"] = value._name
        elif isinstance(value, Gauge | Histogram):
            names[value._name] = value._name
    return names


def test_dashboard_uses_every_metric_and_only_real_ones():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"]
             for target in panel.get("targets", [])]
    used = {name for expr in exprs for name in re.findall(r"\bexitplane_[a-z_]+", expr)}
    exposed = _exposed_names()
    # Gauges read from the store at scrape time (the runtime gauges among them) are real too.
    from_store = {family.name for family in store_collector.describe()}
    assert used <= set(exposed) | from_store, \
        f"unknown metrics: {used - set(exposed) - from_store}"
    assert {exposed[name] for name in used if name in exposed} == set(exposed.values())


def test_dashboard_is_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}"
            if "deployment" in target["legendFormat"] and "rejected" not in target["expr"]:
                assert '"$deployment"' in target["expr"]
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "deployment"}
    assert dashboard["uid"] == "exitplane-control-plane"
