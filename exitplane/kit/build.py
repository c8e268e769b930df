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


def register_process_metrics(registry) -> None:
    """Export what every exitplane process reports on its registry: `exitplane_build_info`,
    the process' CPU, memory, file descriptors and start time (`process_*`), the interpreter
    (`python_info`) and its garbage collector (`python_gc_*`), as prometheus_client's default
    registry would."""
    from prometheus_client import GCCollector, PlatformCollector, ProcessCollector

    register_build_info(registry)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
