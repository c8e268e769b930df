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
    from controlplane.telemetry.gauges import store_collector
    from runtime.server_metrics import ServeMetrics
    from workers.observability import registry as worker_registry

    names = {}
    for registry in (metrics.registry, ServeMetrics(6, "m").registry, worker_registry):
        for collector, exposed in registry._collector_to_names.items():
            for name in exposed:
                # A collector of its own families (store gauges, the runtime's client state)
                # names each family; a client-library metric's names share its shortest one.
                names[name] = (name.removesuffix("_total") if collector is store_collector
                               or not isinstance(collector, Counter | Gauge | Histogram)
                               else min(exposed, key=len))
    return names


# What the control plane's own module exports, and what the dashboard charts.
REQUIRED = {value._name for value in vars(metrics).values()
            if isinstance(value, Counter | Gauge | Histogram)} | {
    "exitplane_exit_rate", "exitplane_shadow_disagreement", "exitplane_disagreement_target",
    "exitplane_mean_exit_depth", "exitplane_estimated_speedup", "exitplane_alerts_open",
    "exitplane_runtime_time_to_first_token_seconds",
    "exitplane_runtime_inter_token_latency_seconds",
    # the fleet view, the runtime server's client state, the long-poll waits
    "exitplane_fleet_runtime_behind_active", "exitplane_fleet_runtime_applied_version",
    "exitplane_runtime_degraded", "exitplane_runtime_threshold_pull_errors",
    "exitplane_config_long_poll_wait_seconds"}


def _exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"]
            for target in panel.get("targets", [])]


def _used() -> set[str]:
    return {name for expr in _exprs() for name in re.findall(r"\bexitplane_[a-z0-9_]+", expr)}


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


# Figures every replica exports alike: every API replica the store-backed fleet view, every
# ingest replica the consumer group's lag. A sum or count straight over them counts each value
# once per replica (tests/observability/test_replica_topology.py shows the values).
SHARED = ("exitplane_stream_lag_entries", "exitplane_dead_letter_entries", "exitplane_fleet_",
          "exitplane_exit_rate", "exitplane_shadow_", "exitplane_disagreement_target",
          "exitplane_alerts_open", "exitplane_mean_exit_depth", "exitplane_estimated_speedup",
          "exitplane_tokens_checked")


def test_no_query_sums_or_counts_a_figure_shared_by_replicas():
    for expr in _exprs():
        for shared in SHARED:
            raw = re.search(rf"\b(sum|count|avg)\s*(by\s*\([^)]*\)\s*)?\(\s*(rate\()?\s*{shared}",
                            expr)
            assert raw is None, expr


def test_the_deployment_picker_reads_a_metric_of_the_api():
    """The API exports it in either telemetry mode (the ingest worker's are Redis-only)."""
    from controlplane.telemetry.gauges import store_collector

    variable = next(v for v in json.loads(DASHBOARD.read_text())["templating"]["list"]
                    if v["name"] == "deployment")
    metric = variable["definition"].removeprefix("label_values(").split(",")[0]
    assert metric in {family.name for family in store_collector.describe()}
