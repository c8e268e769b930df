"""The runtime server exports its threshold client's and shipper's state: a server that reaches
no control plane and has no cached set serves the built-in never-exit set, and /metrics says so
(degraded, version 0, pull errors), with every family present from the first scrape."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from runtime.server import build_state
from runtime.testing import ascii_tokenizer
from tests.support.network import free_port
from tests.support.runtime_server import served_on_a_port, tiny_engine
from tests.support.waiting import wait_until

CLIENT_STATE = {
    "exitplane_runtime_applied_version": "gauge", "exitplane_runtime_degraded": "gauge",
    "exitplane_runtime_threshold_pulls": "counter",
    "exitplane_runtime_threshold_pull_errors": "counter",
    "exitplane_runtime_threshold_sets_refused": "counter",
    "exitplane_runtime_heartbeat_errors": "counter",
    "exitplane_runtime_spooled_batches": "gauge", "exitplane_runtime_dropped_records": "counter",
    "exitplane_runtime_segment_overflow_requests": "counter",
    "exitplane_runtime_segment_unkeyed_requests": "counter",
    "exitplane_runtime_queue_depth": "gauge",
    # the process and build-info collectors every exitplane process exports
    "process_cpu_seconds": "counter", "process_resident_memory_bytes": "gauge",
    "exitplane_build_info": "gauge", "python_info": "gauge"}


def _scrape(url: str) -> dict[str, tuple[str, float]]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {family.name: (family.type, sum(s.value for s in family.samples
                                           if not s.name.endswith("_created")))
            for family in text_string_to_metric_families(text)}


def test_a_runtime_on_its_built_in_set_says_so(tmp_path):
    unreachable = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    state = build_state(engine=tiny_engine(), tokenizer=ascii_tokenizer(), model_name="tiny",
                        control_plane=unreachable, deployment="chat", token="t" * 32,
                        state_dir=tmp_path, max_queue=8)
    with served_on_a_port(state) as served:
        state.thresholds.wait_ready(30)
        scraped = wait_until(lambda: (s := _scrape(served.url))[
            "exitplane_runtime_threshold_pull_errors"][1] >= 1 and s, 30, "a failed pull")
        for name, kind in CLIENT_STATE.items():
            assert scraped[name][0] == kind, name
        assert scraped["exitplane_runtime_degraded"][1] == 1
        assert scraped["exitplane_runtime_applied_version"][1] == 0
        assert scraped["exitplane_runtime_threshold_sets_refused"][1] == 0
        assert scraped["exitplane_runtime_spooled_batches"][1] == 0
        assert httpx.get(f"{served.url}/readyz", timeout=10).status_code == 503
        # Every layer a token can leave at and every request outcome has its series at 0.
        text = httpx.get(f"{served.url}/metrics", timeout=10).text
        layers = state.engine.parts.num_layers
        for layer in range(1, layers + 1):
            assert f'exitplane_runtime_exits_total{{layer="{layer}"}} 0.0' in text
        for outcome in ("ok", "error", "rejected"):
            assert f'exitplane_runtime_requests_total{{outcome="{outcome}"}} 0.0' in text
