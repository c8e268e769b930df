"""The Grafana dashboard stays in step with the control plane's Prometheus metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import Counter, Gauge, Histogram

from controlplane import metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "grafana" / "exitplane.json"


def _exposed_names() -> dict[str, str]:
    """Exposed series name -> the metric it belongs to (counters gain `_total`), for every
    process the dashboard reads: control plane (own, HTTP and store gauges), runtime, worker."""
    from controlplane import observability  # noqa: F401  (registers the HTTP histogram)
    from controlplane.alerts.exporter import store_collector
    from runtime.server_metrics import ServeMetrics
    from workers.observability import registry as worker_registry

    names = {}
    for registry in (metrics.registry, ServeMetrics(6, "m").registry, worker_registry):
        for collector, exposed in registry._collector_to_names.items():
            for name in exposed:
                names[name] = name if collector is store_collector else min(exposed, key=len)
    return names


# What the control plane's own module exports, and what issue 15 asked the dashboard to chart.
REQUIRED = {value._name for value in vars(metrics).values()
            if isinstance(value, Counter | Gauge | Histogram)} | {
    "exitplane_exit_rate", "exitplane_shadow_disagreement", "exitplane_disagreement_target",
    "exitplane_mean_exit_depth", "exitplane_estimated_speedup", "exitplane_alerts_open",
    "exitplane_runtime_time_to_first_token_seconds",
    "exitplane_runtime_inter_token_latency_seconds"}


def _used() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"]
             for target in panel.get("targets", [])]
    return {name for expr in exprs for name in re.findall(r"\bexitplane_[a-z0-9_]+", expr)}


def test_dashboard_uses_every_metric_and_only_real_ones():
    used, exposed = _used(), _exposed_names()
    assert used <= set(exposed), f"unknown metrics: {used - set(exposed)}"
    assert {exposed[name] for name in used} >= REQUIRED, REQUIRED - {exposed[n] for n in used}


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
