"""The release version has one definition (pyproject.toml, read through the installed
distribution's metadata) and every surface reports that one: the CLI (tests/test_cli_help.py),
/healthz, the OpenAPI document (served and committed) and the `exitplane_build_info` gauge on
each process's /metrics (API and ingest worker share controlplane.metrics.registry; Celery
workers serve workers.observability.registry; the runtime server: tests/runtime_server/
test_build_info.py)."""

from __future__ import annotations

import json
import platform
import re
import tomllib
from importlib.metadata import version
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import exitplane
from exitplane.kit.build import BUILD_INFO

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("controlplane", "dashboards", "exitplane", "runtime", "workers", "migrations")


def _build_info(text: str) -> list[dict[str, str]]:
    return [sample.labels for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == BUILD_INFO and sample.value == 1]


def test_the_version_is_pyprojects_and_written_nowhere_else():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert exitplane.__version__ == version("exitplane") == declared
    literal = re.compile(r"""["']""" + re.escape(declared) + r"""["']""")
    copies = [str(path.relative_to(ROOT)) for package in PRODUCT
              for path in (ROOT / package).rglob("*.py") if literal.search(path.read_text())]
    assert copies == [], f"the version is written out in {copies}: read exitplane.__version__"


def test_healthz_and_the_openapi_document_report_the_version(client):
    assert client.get("/healthz").json()["version"] == exitplane.__version__
    assert client.get("/openapi.json").json()["info"]["version"] == exitplane.__version__
    committed = json.loads((ROOT / "docs" / "openapi.json").read_text())
    assert committed["info"]["version"] == exitplane.__version__


def test_the_api_metrics_carry_build_info(client):
    labels = _build_info(client.get("/metrics").text)
    assert labels == [{"version": exitplane.__version__, "python": platform.python_version()}]


def test_the_ingest_and_celery_worker_registries_carry_build_info():
    from controlplane.metrics import registry as api_and_ingest
    from workers.observability import registry as celery_worker

    for registry in (api_and_ingest, celery_worker):
        assert _build_info(generate_latest(registry).decode()) == [
            {"version": exitplane.__version__, "python": platform.python_version()}]
