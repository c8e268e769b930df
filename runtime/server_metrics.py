"""Metrics of the runtime server (one process, one registry, no `runtime` label: the scrape
target names it).

- Request-level latency and token metrics, named and bucketed after vLLM's
  (`vllm:time_to_first_token_seconds` -> `exitplane_runtime_time_to_first_token_seconds`, ...),
  so dashboards and alerts written for vLLM fleets carry over; each has a `model_name` label.
- Engine steps, exits per layer, shadow tokens and shadow requests (the cost of measuring
  agreement: tokens and whole requests run at full depth) and requests by outcome, counted as
  they happen.
- The threshold client's and the telemetry shipper's state (applied version, built-in fallback,
  pulls, pull errors, refused sets, spool, drops) and the segment router's counts, read from
  them at scrape time (`ServeMetrics.watch`): counts are counters, levels gauges.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from exitplane.kit.build import register_process_metrics

# vLLM's buckets (vllm/engine/metrics.py), seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class RequestMetrics:
    """The request-level families, registered on the server's registry."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        labels = ["model_name"]
        self.ttft = Histogram("exitplane_runtime_time_to_first_token_seconds",
                              "Time from request arrival to its first generated token", labels,
                              buckets=TTFT_BUCKETS, registry=registry)
        self.itl = Histogram("exitplane_runtime_inter_token_latency_seconds",
                             "Time between consecutive generated tokens of a request", labels,
                             buckets=ITL_BUCKETS, registry=registry)
        self.e2e = Histogram("exitplane_runtime_e2e_request_latency_seconds",
                             "Time from request arrival to its last token", labels,
                             buckets=E2E_BUCKETS, registry=registry)
        self.prompt_tokens = Counter("exitplane_runtime_prompt_tokens",
                                     "Prompt tokens of finished requests", labels,
                                     registry=registry)
        self.generation_tokens = Counter("exitplane_runtime_generation_tokens",
                                         "Tokens generated for finished requests", labels,
                                         registry=registry)
        for family in (self.ttft, self.itl, self.e2e, self.prompt_tokens,
                       self.generation_tokens):
            family.labels(model_name)  # the series exist (at zero) before the first request

    def timer(self, prompt_tokens: int) -> RequestTimer:
        return RequestTimer(self, prompt_tokens)


class RequestTimer:
    """One request's clock: call `token()` per generated token and `finish()` once."""

    def __init__(self, metrics: RequestMetrics, prompt_tokens: int) -> None:
        self.metrics = metrics
        self.prompt_tokens = prompt_tokens
        self.arrived = time.perf_counter()
        self.first: float | None = None  # when the first token was generated
        self.last: float | None = None
        self.generated = 0
        self.finished = False

    def token(self) -> None:
        now = time.perf_counter()
        m, name = self.metrics, self.metrics.model_name
        if self.last is None:
            self.first = now
            m.ttft.labels(name).observe(now - self.arrived)
        else:
            m.itl.labels(name).observe(now - self.last)
        self.last = now
        self.generated += 1

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        m, name = self.metrics, self.metrics.model_name
        m.e2e.labels(name).observe(time.perf_counter() - self.arrived)
        m.prompt_tokens.labels(name).inc(self.prompt_tokens)
        m.generation_tokens.labels(name).inc(self.generated)


# Request outcomes counted by `exitplane_runtime_requests_total`.
OUTCOMES = ("ok", "error", "rejected")


class ServeMetrics:
    """Every family the runtime server exports, on its own registry: engine steps, exits per
    layer, requests by outcome, the request latencies above, and (at scrape time) the state of
    the server's threshold client, shipper and segment router."""

    def __init__(self, num_layers: int, model_name: str = "model") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        register_process_metrics(r)
        self.request = RequestMetrics(r, model_name)  # vLLM-style request latencies
        self.tokens = Counter("exitplane_runtime_tokens", "Generated tokens", registry=r)
        self.requests = Counter("exitplane_runtime_requests", "Requests by outcome", ["outcome"],
                                registry=r)
        self.cancelled = Counter("exitplane_runtime_cancelled", "Requests cancelled",
                                 registry=r)
        self.batch_size = Histogram("exitplane_runtime_batch_size", "Rows per decode step",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.step_seconds = Histogram("exitplane_runtime_step_seconds", "Decode step time",
                                      registry=r)
        self.exits = Counter("exitplane_runtime_exits", "Tokens by exit layer", ["layer"],
                             registry=r)
        self.shadow_tokens = Counter(
            "exitplane_runtime_shadow_tokens",
            "Tokens computed at full depth to measure their exit layers' agreement (shadow "
            "tokens, including every token of a shadow request)", registry=r)
        self.shadow_requests = Counter(
            "exitplane_runtime_shadow_requests",
            "Requests served whole at full depth as shadow requests, counted at their last "
            "token", registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        for layer in range(1, num_layers + 1):  # every layer a token can leave at, from 0
            self.exits.labels(str(layer))
        self.state = ServerStateCollector()
        r.register(self.state)
        self.num_layers = num_layers

    def watch(self, state: Any) -> None:
        """Export `state`'s (a ServeState) threshold client, shipper, segments and queue."""
        self.state.state = state

    def observe_step(self, outputs: list, seconds: float) -> None:
        if not outputs:
            return
        self.batch_size.observe(len(outputs))
        self.step_seconds.observe(seconds)
        self.tokens.inc(len(outputs))
        for output in outputs:
            record = output.record
            self.exits.labels(str(record.exit_layer)).inc()
            if record.shadow is not None:
                self.shadow_tokens.inc()
                if record.shadow_request and record.request_end:
                    self.shadow_requests.inc()


def _gauge(name: str, doc: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"exitplane_runtime_{name}", doc)


def _counter(name: str, doc: str) -> CounterMetricFamily:
    return CounterMetricFamily(f"exitplane_runtime_{name}", doc)


class ServerStateCollector(Collector):
    """The server's state, read when scraped. Before `ServeMetrics.watch` (and for a server on a
    static set, with no client or shipper) every family is still exported, at 0."""

    def __init__(self) -> None:
        self.state: Any = None

    def describe(self):
        return list(self._families().values())

    @staticmethod
    def _families() -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
        return {
            "queue_depth": _gauge("queue_depth", "Requests waiting or running"),
            "applied_version": _gauge("applied_version",
                                      "Threshold version the engine applies (0: the built-in "
                                      "never-exit set)"),
            "degraded": _gauge("degraded",
                               "1 while serving the built-in never-exit set: neither the control "
                               "plane nor the cache had a set"),
            "threshold_pulls": _counter(
                "threshold_pulls", "Threshold pulls the control plane answered (200, 304 or an "
                "error)"),
            "threshold_pull_errors": _counter(
                "threshold_pull_errors",
                "Threshold pulls that failed: control plane unreachable or an error answer"),
            "threshold_sets_refused": _counter(
                "threshold_sets_refused",
                "Threshold sets refused (checksum, schema, or exit layers the engine lacks)"),
            "heartbeat_errors": _counter("heartbeat_errors",
                                         "Heartbeats the control plane did not take"),
            "spooled_batches": _gauge("spooled_batches",
                                      "Telemetry batches on disk, waiting for the control plane"),
            "dropped_records": _counter("dropped_records",
                                        "Telemetry records lost: queue full, or spool "
                                        "cap reached"),
            "segments_tracked": _gauge("segments_tracked",
                                       "Segment names tracked besides default"),
            "segment_overflow_requests": _counter(
                "segment_overflow_requests",
                "Requests run as default: their segment was past the cap"),
            "segment_unkeyed_requests": _counter(
                "segment_unkeyed_requests",
                "Requests run as default: a server without API keys takes no new segment name "
                "from a request"),
        }

    def collect(self):
        families = self._families()
        values = dict.fromkeys(families, 0)
        state = self.state
        if state is not None:
            values["queue_depth"] = state.worker.in_flight
            values["applied_version"] = state.engine.policy.version
            values["segments_tracked"] = len(state.segments.tracked)
            values["segment_overflow_requests"] = state.segments.overflow
            values["segment_unkeyed_requests"] = state.segments.unkeyed
            client = state.thresholds
            if client is not None:
                counters = client.counters
                values["degraded"] = int(client.degraded)
                values["threshold_pulls"] = counters["pulls"]
                values["threshold_pull_errors"] = counters["pull_errors"]
                values["threshold_sets_refused"] = counters["refused"]
                values["heartbeat_errors"] = counters["heartbeat_errors"]
            shipper = state.shipper
            if shipper is not None:
                values["spooled_batches"] = shipper.spooled_batches
                values["dropped_records"] = shipper.dropped_records
        for name, family in families.items():
            family.add_metric([], values[name] or 0)
            yield family
