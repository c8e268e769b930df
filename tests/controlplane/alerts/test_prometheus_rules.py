"""The Prometheus rules are valid (promtool check), behave as intended on synthetic series
(promtool test), and every metric they read is exported by /metrics with store values."""

import re
import shutil
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from controlplane.db import utcnow
from controlplane.runtimes.service import record_heartbeat
from exitplane.wire import Heartbeat
from tests.controlplane.alerts.support import Phase, make_deployment, send_traffic

RULES = Path(__file__).resolve().parents[3] / "dashboards" / "prometheus"


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        raise RuntimeError("install Debian's prometheus package (apt-get install -y "
                           "prometheus) for promtool")
    return found


def test_rules_are_valid(promtool):
    checked = subprocess.run([promtool, "check", "rules", str(RULES / "alerts.yml")],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 7 rules found" in checked.stdout


def test_rules_fire_on_the_series_they_watch(promtool):
    tested = subprocess.run([promtool, "test", "rules", "alerts_test.yml"], cwd=RULES,
                            capture_output=True, text=True, timeout=120)
    assert tested.returncode == 0, tested.stdout + tested.stderr


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
    text = client.get("/metrics").text
    used = set(re.findall(r"exitplane_[a-z_]+", (RULES / "alerts.yml").read_text()))
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
                if line.startswith("exitplane_")}
    assert used - {"exitplane_runtime_spooled_batches"} <= exported
    assert 0.3 < _sample(text, "exitplane_exit_rate", deployment="chat", layer="8") < 0.5
    assert _sample(text, "exitplane_tokens_checked", deployment="chat", layer="4") == 1500
    assert 0.05 < _sample(text, "exitplane_shadow_disagreement", deployment="chat") < 0.15
    assert _sample(text, "exitplane_disagreement_target", deployment="chat") == 0.02
    assert _sample(text, "exitplane_runtime_behind_active", runtime="rt-old") == 1.0
    assert _sample(text, "exitplane_runtime_behind_active", runtime="rt-1") == 0.0
    assert abs(_sample(text, "exitplane_last_ingest_timestamp_seconds", deployment="chat")
               - now.timestamp()) < 600
    # Mean exit depth and speed-up (issue 15) agree with the per-layer gauges.
    from tests.controlplane.alerts.support import FULL, LAYERS

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
