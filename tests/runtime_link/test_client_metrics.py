"""The optional Prometheus collector (`exitplane.client.metrics`): every key of
`Runtime.metrics` is an `exitplane_client_*` metric, documented in docs/client.md, whose
values follow the client's counters and gauges at each scrape, per deployment and runtime id;
and the client imports and runs without prometheus_client, which only the collector needs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from exitplane.client import AsyncRuntime, Runtime
from exitplane.client.metrics import METRICS, ClientCollector, register
from exitplane.wire import ThresholdSetWire
from tests.support.runtime_link import DEPLOYMENT, EXIT_LAYERS, NUM_LAYERS, publish
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
FAST = {"long_poll_s": 0.5, "heartbeat_interval_s": 0.3, "backoff_initial_s": 0.05,
        "backoff_max_s": 0.3}


def _sample(registry, key: str, runtime_id: str) -> float | None:
    suffix = "_total" if METRICS[key][0] == "counter" else ""
    return registry.get_sample_value(f"exitplane_client_{key}{suffix}",
                                     {"deployment": DEPLOYMENT, "runtime_id": runtime_id})


def test_every_metric_is_named_typed_and_documented(tmp_path):
    rt = Runtime(deployment=DEPLOYMENT, runtime_id="listed-1", num_layers=NUM_LAYERS,
                 exit_layers=EXIT_LAYERS, url="http://127.0.0.1:9", token="t",
                 state_dir=tmp_path / "state", raw_sample_rate=0.5)
    try:
        assert set(rt.metrics) == set(METRICS)
    finally:
        rt.shipper.close(1)
        rt.thresholds.stop(1)
    guide = (ROOT / "docs" / "client.md").read_text()
    for key, (kind, _) in METRICS.items():
        assert kind in ("counter", "gauge"), key
        name = f"exitplane_client_{key}" + ("_total" if kind == "counter" else "")
        assert f"| `{name}` | {kind} |" in guide, name


def test_the_collector_reads_each_runtime_at_each_scrape(tmp_path):
    path = tmp_path / "set.json"
    path.write_text(ThresholdSetWire.build(deployment=DEPLOYMENT, version=5, signal="maxprob",
                                           thresholds={2: 0.9, 4: 0.8}).model_dump_json())
    options = {"deployment": DEPLOYMENT, "num_layers": NUM_LAYERS, "exit_layers": EXIT_LAYERS,
               "offline_file": path, "file_check_s": 3600}
    registry = CollectorRegistry()
    with Runtime(runtime_id="plain-1", **options) as plain:
        wrapped = AsyncRuntime(runtime_id="async-1", **options)
        register(plain, wrapped, registry=registry)
        for position in range(3):
            plain.record(request_id="r", position=position, exit_layer=2, signal_value=0.95)
        assert _sample(registry, "dropped_offline", "plain-1") == 3
        assert _sample(registry, "dropped_offline", "async-1") == 0
        wrapped.record(request_id="r", position=0, exit_layer=2, signal_value=0.95)
        assert _sample(registry, "dropped_offline", "async-1") == 1
        assert _sample(registry, "offline", "plain-1") == 1
    text = generate_latest(registry).decode()
    assert "# TYPE exitplane_client_offline gauge" in text


@pytest.mark.slow  # a control plane, seconds of polling
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_metrics_follow_the_client_s_counters(control_plane, operator, runtime_token,
                                                  tmp_path):
    first = publish(operator, {2: 0.9, 4: 0.9})
    registry = CollectorRegistry()
    with Runtime(url=control_plane.url, token=runtime_token, deployment=DEPLOYMENT,
                 runtime_id="scraped-1", num_layers=NUM_LAYERS, exit_layers=EXIT_LAYERS,
                 state_dir=tmp_path / "state", threshold_options=FAST,
                 shipper_options={"batch_interval_s": 0.05, "fsync": False}) as rt:
        registry.register(ClientCollector(rt))
        assert _sample(registry, "thresholds_applied_version", "scraped-1") == first
        assert _sample(registry, "thresholds_ready", "scraped-1") == 1
        for position in range(25):
            rt.record(request_id="m", position=position, exit_layer=4, signal_value=0.5)
        assert rt.flush(10)
        assert _sample(registry, "telemetry_sent_records", "scraped-1") == 25 \
            == rt.metrics["telemetry_sent_records"]
        second = publish(operator, {2: 0.8, 4: 0.8})
        wait_until(lambda: _sample(registry, "thresholds_applied_version", "scraped-1")
                   == second, message="the gauge follows the applied set")
        wait_until(lambda: (_sample(registry, "thresholds_heartbeats", "scraped-1") or 0) >= 2,
                   message="the heartbeat counter grows")
        assert _sample(registry, "thresholds_applied", "scraped-1") \
            == rt.metrics["thresholds_applied"] >= 2


BLOCKED = textwrap.dedent("""
    import importlib.abc, sys

    class NoPrometheus(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "prometheus_client" or name.startswith("prometheus_client."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoPrometheus())
    """)


def test_the_client_works_without_prometheus_client(tmp_path):
    path = tmp_path / "set.json"
    path.write_text(ThresholdSetWire.build(deployment=DEPLOYMENT, version=2, signal="maxprob",
                                           thresholds={2: 0.9, 4: 0.8}).model_dump_json())
    probe = BLOCKED + textwrap.dedent(f"""
        import exitplane.client, exitplane.client.aio, exitplane.client.metrics
        from exitplane.client import Runtime
        from exitplane.client.metrics import ClientCollector
        with Runtime(deployment={DEPLOYMENT!r}, runtime_id="bare-1", num_layers={NUM_LAYERS},
                     exit_layers={EXIT_LAYERS!r}, offline_file={str(path)!r}) as rt:
            assert rt.version == 2 and rt.metrics["offline"] == 1
            try:
                ClientCollector(rt)
            except ModuleNotFoundError as error:
                print("refused:", error)
        assert "prometheus_client" not in sys.modules
        """)
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env={"PATH": os.environ["PATH"]})
    assert run.returncode == 0, run.stderr
    assert "refused:" in run.stdout and "pip install prometheus-client" in run.stdout
