"""What every process reports about the release it runs: the version (`exitplane.__version__`,
read from the installed distribution) and an `exitplane_build_info` gauge for its /metrics."""

from __future__ import annotations

import platform

from exitplane import __version__

BUILD_INFO = "exitplane_build_info"


def register_build_info(registry) -> None:
    """Export `exitplane_build_info{version, python} 1` on a prometheus_client registry, so a
    dashboard can tell which release (and interpreter) each scrape target runs."""
    from prometheus_client import Gauge

    gauge = Gauge(BUILD_INFO, "The exitplane release this process runs (always 1)",
                  ["version", "python"], registry=registry)
    gauge.labels(__version__, platform.python_version()).set(1)
