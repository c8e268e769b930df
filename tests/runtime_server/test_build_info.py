"""The runtime server reports the release it runs: /healthz names the version, /metrics has
`exitplane_build_info`, and its OpenAPI info carries the same version."""

from __future__ import annotations

import platform

import httpx
from prometheus_client.parser import text_string_to_metric_families

from exitplane import __version__
from runtime.server import build_state
from runtime.testing import ascii_tokenizer
from tests.support.runtime_server import never_exit, served_on_a_port, tiny_engine


def test_healthz_metrics_and_openapi_report_the_version():
    state = build_state(engine=tiny_engine(), tokenizer=ascii_tokenizer(),
                        model_name="tiny-llama", control_plane=None, deployment=None,
                        token=None, state_dir=None,
                        static_thresholds=never_exit(), max_queue=8)
    with served_on_a_port(state) as served:
        health = httpx.get(f"{served.url}/healthz", timeout=10).json()
        metrics = httpx.get(f"{served.url}/metrics", timeout=10).text
        info = httpx.get(f"{served.url}/openapi.json", timeout=10).json()["info"]
    assert health["version"] == __version__
    assert info["version"] == __version__
    build = [sample.labels for family in text_string_to_metric_families(metrics)
             for sample in family.samples if sample.name == "exitplane_build_info"]
    assert build == [{"version": __version__, "python": platform.python_version()}]
