"""The client's counters and gauges (`Runtime.metrics`) on a Prometheus registry.

    from exitplane.client.metrics import register
    register(rt)  # prometheus_client's default registry; or register(rt, registry=...)

Each key of `Runtime.metrics` is a metric `exitplane_client_<key>` (counters end in `_total`),
labelled with the runtime's `deployment` and `runtime_id`, read from the runtime at each
scrape. prometheus_client is not a dependency of the client: it is imported when a collector
is made, and a clear error says to install it when it is missing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

PREFIX = "exitplane_client_"
LABELS = ("deployment", "runtime_id")

# key of Runtime.metrics -> (kind, help); docs/client.md lists the same metrics.
METRICS: dict[str, tuple[str, str]] = {
    "offline": ("gauge", "1 when running from a threshold set file with no control plane"),
    "dropped_offline": ("counter", "tokens recorded while offline (not shipped)"),
    "shadow_rate": ("gauge", "the shadow rate applied: the control plane's, else the local one"),
    "shadow_request_rate": ("gauge", "the shadow-request rate applied: the control plane's, "
                            "else the local one"),
    "shadow_requests": ("counter", "requests drawn to be served as shadow requests"),
    "thresholds_pulls": ("counter", "threshold set pulls answered"),
    "thresholds_not_modified": ("counter", "pulls answered 304: the applied set is current"),
    "thresholds_applied": ("counter", "threshold sets applied"),
    "thresholds_refused": ("counter", "threshold sets refused (the current one stays)"),
    "thresholds_pull_errors": ("counter", "pulls that failed (unreachable or an error answer)"),
    "thresholds_heartbeats": ("counter", "heartbeats the control plane took"),
    "thresholds_heartbeat_errors": ("counter", "heartbeats that failed or were refused"),
    "thresholds_cache_write_errors": ("counter", "failed writes of the last good set's cache"),
    "thresholds_ready": ("gauge", "1 once a threshold set is applied"),
    "thresholds_degraded": ("gauge", "1 while serving the built-in never-exit set"),
    "thresholds_builtin_fallback": ("gauge", "1 while serving the built-in never-exit set"),
    "thresholds_applied_version": ("gauge", "the applied threshold set's version (-1: none)"),
    "thresholds_control_plane_shadow_rate": ("gauge", "the shadow rate the control plane sets "
                                             "(-1: none)"),
    "thresholds_control_plane_shadow_request_rate": ("gauge", "the shadow-request rate the "
                                                     "control plane sets (-1: none)"),
    "telemetry_sent_batches": ("counter", "record batches delivered"),
    "telemetry_sent_records": ("counter", "token records delivered"),
    "telemetry_duplicate_batches": ("counter", "batches the control plane already held"),
    "telemetry_spooled_batches": ("counter", "batches written to the disk spool"),
    "telemetry_replayed_batches": ("counter", "spooled batches delivered on replay"),
    "telemetry_dropped_spool_records": ("counter", "records dropped at a full spool"),
    "telemetry_rejected_batches": ("counter", "batches the control plane refused for good"),
    "telemetry_rejected_records": ("counter", "records in refused batches"),
    "telemetry_retries": ("counter", "telemetry sends retried"),
    "telemetry_send_errors": ("counter", "telemetry sends that failed"),
    "telemetry_auth_errors": ("counter", "telemetry sends refused for the token or runtime id"),
    "telemetry_splits": ("counter", "batches split in halves after a 413"),
    "telemetry_sent_aggregate_batches": ("counter", "aggregate and interval batches delivered"),
    "telemetry_sent_aggregate_tokens": ("counter", "tokens counted in delivered aggregates"),
    "telemetry_dropped_aggregate_tokens": ("counter", "aggregated tokens dropped at a full spool"),
    "telemetry_rejected_aggregate_tokens": ("counter", "aggregated tokens in refused batches"),
    "telemetry_duplicate_records": ("counter", "records in batches already held"),
    "telemetry_duplicate_aggregate_tokens": ("counter", "aggregated tokens already held"),
    "telemetry_set_aside_batches": ("counter", "spooled batches set aside after server errors"),
    "telemetry_recovered_aside_batches": ("counter", "set-aside batches delivered later"),
    "telemetry_dropped_queue_records": ("counter", "records dropped at a full queue"),
    "telemetry_dropped_records": ("counter", "records and aggregated tokens lost in all"),
    "telemetry_queue_depth": ("gauge", "records queued in memory"),
    "telemetry_spool_pending_batches": ("gauge", "batches in the spool waiting for replay"),
    "telemetry_spool_aside_batches": ("gauge", "batches set aside in the spool"),
    "telemetry_spool_bytes": ("gauge", "bytes the spool holds on disk"),
    "telemetry_online": ("gauge", "1 while the control plane takes telemetry"),
}


class Measured(Protocol):
    """What the collector reads: a `Runtime` or an `AsyncRuntime`."""

    deployment: str
    runtime_id: str

    @property
    def metrics(self) -> dict[str, Any]: ...


class ClientCollector:
    """A prometheus_client collector of one or more runtimes' `metrics`."""

    def __init__(self, *runtimes: Measured) -> None:
        self._families = _prometheus_families()
        self.runtimes = list(runtimes)

    def collect(self) -> Iterator[Any]:
        """One family per metric, a sample per runtime (called at each scrape)."""
        counter, gauge, untyped = self._families
        readings = [([runtime.deployment, runtime.runtime_id], runtime.metrics)
                    for runtime in self.runtimes]
        keys = dict.fromkeys(key for _, metrics in readings for key in metrics)
        for key in keys:
            kind, documentation = METRICS.get(key, ("untyped", f"the client's {key}"))
            family = {"counter": counter, "gauge": gauge}.get(kind, untyped)(
                PREFIX + key, documentation, labels=LABELS)
            for labels, metrics in readings:
                if key in metrics:
                    family.add_metric(labels, float(metrics[key]))
            yield family


def register(*runtimes: Measured, registry: Any = None) -> ClientCollector:
    """Register a collector of `runtimes` on `registry` (default: prometheus_client's
    default registry) and return it."""
    collector = ClientCollector(*runtimes)
    if registry is None:
        from prometheus_client import REGISTRY as registry
    registry.register(collector)
    return collector


def _prometheus_families() -> tuple[type, type, type]:
    try:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            UnknownMetricFamily,
        )
    except ImportError as exc:
        raise ModuleNotFoundError(
            "exitplane.client.metrics needs prometheus_client, which the client does not "
            "install: pip install prometheus-client", name="prometheus_client") from exc
    return CounterMetricFamily, GaugeMetricFamily, UnknownMetricFamily
