"""The Prometheus rules are valid (promtool check), behave as intended on synthetic series
(promtool test), and every metric they read is exported by /metrics with store values."""

import re
import shutil
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from sqlalchemy.orm import Session

from controlplane.db import utcnow
from controlplane.runtimes.service import record_heartbeat
from exitplane.wire import Heartbeat
from tests.support.alerts import Phase, make_deployment, send_traffic

RULES = Path(__file__).resolve().parents[3] / "dashboards" / "prometheus"


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        raise RuntimeError("install Debian's prometheus package (apt-get install -y "
                           "prometheus) for promtool")
    return found


def _alerts() -> list[dict]:
    rules = yaml.safe_load((RULES / "alerts.yml").read_text())
    return [rule for group in rules["groups"] for rule in group["rules"] if "alert" in rule]


def test_rules_are_valid(promtool):
    checked = subprocess.run([promtool, "check", "rules", str(RULES / "alerts.yml")],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in checked.stdout


def test_rules_fire_on_the_series_they_watch(promtool):
    tested = subprocess.run([promtool, "test", "rules", "alerts_test.yml"], cwd=RULES,
                            capture_output=True, text=True, timeout=120)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_rule_is_unit_tested_firing():
    """Each rule has at least one promtool case where it fires (exp_alerts not empty)."""
    cases = yaml.safe_load((RULES / "alerts_test.yml").read_text())["tests"]
    firing = {check["alertname"] for case in cases for check in case["alert_rule_test"]
              if check.get("exp_alerts")}
    names = {rule["alert"] for rule in _alerts()}
    assert len(names) >= 15
    assert names - firing == set(), f"rules no promtool case sees firing: {names - firing}"


def test_control_plane_health_and_runtime_objectives_have_rules():
    """The control plane's own health and the runtimes' latency objectives are watched."""
    exprs = {rule["alert"]: rule["expr"] for rule in _alerts()}
    wanted = {"up{": "scrape targets down",
              'status=~"5.."': "API 5xx answers",
              "exitplane_worker_task_failures_total": "worker task failures",
              "exitplane_dead_lettered_batches_total": "dead letters",
              "exitplane_stream_lag_entries": "stream lag",
              "exitplane_runtime_time_to_first_token_seconds_bucket": "time to first token",
              "exitplane_runtime_inter_token_latency_seconds_bucket": "inter-token latency",
              "exitplane_runtime_degraded": "a runtime on its built-in fallback"}
    missing = [what for needle, what in wanted.items()
               if not any(needle in expr for expr in exprs.values())]
    assert missing == []
    # Figures every replica reports alike are never summed over replicas.
    for name, expr in exprs.items():
        for shared in ("exitplane_stream_lag_entries", "exitplane_fleet_runtime_",
                       "exitplane_exit_rate", "exitplane_shadow_disagreement"):
            assert not re.search(rf"\b(sum|count)\s*(by\s*\([^)]*\))?\s*\(\s*{shared}", expr), \
                (name, expr)


def _sample(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{labels} not exported")


def test_metrics_the_rules_read_are_exported_from_the_store(client, engine, outbox):
    now = utcnow()
    with Session(engine) as session:
        deployment = make_deployment(session, delta=0.02, activated_at=now - timedelta(hours=1))
        send_traffic(session, deployment, start=now - timedelta(minutes=3), seed=11,
                     phases=[Phase(3, (0.25, 0.4, 0.3), shadow_rate=0.2, mismatch_rate=0.1)])
        record_heartbeat(session=session, deployment=deployment,
                         beat=Heartbeat(runtime_id="rt-1", applied_version=2))
        record_heartbeat(session=session, deployment=deployment,
                         beat=Heartbeat(runtime_id="rt-old", applied_version=1))
        session.commit()
    client.get("/metrics")  # the first scrape creates every deployment's counters at 0
    text = client.get("/metrics").text
    used = {name for rule in _alerts() for name in re.findall(r"exitplane_[a-z_]+", rule["expr"])}
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
                if line.startswith("exitplane_")}
    # What other processes export: the runtime server, the Celery workers, the ingest worker.
    elsewhere = {name for name in used if name.startswith(("exitplane_runtime_",
                                                           "exitplane_worker_"))}
    elsewhere |= {"exitplane_stream_lag_entries"}
    assert used - elsewhere <= exported, used - elsewhere - exported
    assert 0.3 < _sample(text, "exitplane_exit_rate", deployment="chat", layer="8") < 0.5
    assert _sample(text, "exitplane_tokens_checked", deployment="chat", layer="4") == 1500
    assert 0.05 < _sample(text, "exitplane_shadow_disagreement", deployment="chat") < 0.15
    assert _sample(text, "exitplane_disagreement_target", deployment="chat") == 0.02
    assert _sample(text, "exitplane_fleet_runtime_behind_active", runtime="rt-old") == 1.0
    assert _sample(text, "exitplane_fleet_runtime_behind_active", runtime="rt-1") == 0.0
    assert abs(_sample(text, "exitplane_last_ingest_timestamp_seconds", deployment="chat")
               - now.timestamp()) < 600
    # Mean exit depth and speed-up agree with the per-layer gauges.
    from tests.support.alerts import FULL, LAYERS

    tokens = _sample(text, "exitplane_tokens_checked", deployment="chat", layer=str(LAYERS[0]))
    exits = {layer: _sample(text, "exitplane_exit_rate", deployment="chat", layer=str(layer))
             * _sample(text, "exitplane_tokens_checked", deployment="chat", layer=str(layer))
             for layer in LAYERS}
    depth = (sum(n * layer for layer, n in exits.items())
             + (tokens - sum(exits.values())) * FULL) / tokens
    assert _sample(text, "exitplane_mean_exit_depth", deployment="chat") == pytest.approx(depth)
    assert _sample(text, "exitplane_estimated_speedup", deployment="chat") == \
        pytest.approx(FULL / depth)
    assert 1.2 < FULL / depth < FULL


def test_labelled_counters_start_at_zero_for_known_label_values():
    """Refusal reasons are the DomainError classes `refused` counts by, and a deployment's
    counters exist at 0 once primed, before its first batch."""
    import controlplane.edge.app  # noqa: F401  (every domain's errors)
    from controlplane import metrics
    from controlplane.errors import DomainError

    def subclasses(cls) -> set[str]:
        return {cls.__name__}.union(*(subclasses(sub) for sub in cls.__subclasses__()))

    assert set(metrics.REJECT_REASONS) <= subclasses(DomainError)
    metrics.prime(deployments=["primed-only"])
    text = generate_latest(metrics.registry).decode()
    for reason in metrics.REJECT_REASONS:  # earlier tests in this process may have counted
        assert f'exitplane_rejected_batches_total{{reason="{reason}"}} ' in text
    for family in ("ingested_records", "queued_batches", "dead_lettered_batches"):
        assert f'exitplane_{family}_total{{deployment="primed-only"}} 0.0' in text
