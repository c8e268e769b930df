"""Request-level latency and token metrics of the runtime server, named and bucketed after vLLM's
(`vllm:time_to_first_token_seconds` -> `exitplane_runtime_time_to_first_token_seconds`, ...), so
dashboards and alerts written for vLLM fleets carry over. Every series has a `model_name` label.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from exitplane.build import register_build_info

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
        self.last: float | None = None
        self.generated = 0
        self.finished = False

    def token(self) -> None:
        now = time.perf_counter()
        m, name = self.metrics, self.metrics.model_name
        if self.last is None:
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


class ServeMetrics:
    """Every family the runtime server exports, on its own registry: engine steps, exits per
    layer, queue depth, the applied threshold version, telemetry spool, and the request
    latencies above."""

    def __init__(self, num_layers: int, model_name: str = "model") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        register_build_info(r)
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
        self.queue_depth = Gauge("exitplane_runtime_queue_depth", "Requests waiting or running",
                                 registry=r)
        self.applied_version = Gauge("exitplane_runtime_applied_version",
                                     "Threshold version applied", registry=r)
        self.spooled = Gauge("exitplane_runtime_spooled_batches", "Telemetry batches on disk",
                             registry=r)
        self.dropped = Gauge("exitplane_runtime_dropped_records", "Telemetry records dropped",
                             registry=r)
        # Traffic segments: names accepted besides `default`, and requests whose
        # new name found the cap reached and ran as `default`.
        self.segments_tracked = Gauge("exitplane_runtime_segments_tracked",
                                      "Segment names tracked besides default", registry=r)
        self.segment_overflow = Gauge("exitplane_runtime_segment_overflow_requests",
                                      "Requests run as default: their segment was past the cap",
                                      registry=r)
        self.segment_unkeyed = Gauge(
            "exitplane_runtime_segment_unkeyed_requests",
            "Requests run as default: a server without API keys takes no new segment name "
            "from a request", registry=r)
        self.num_layers = num_layers

    def observe_step(self, outputs: list, seconds: float) -> None:
        if not outputs:
            return
        self.batch_size.observe(len(outputs))
        self.step_seconds.observe(seconds)
        self.tokens.inc(len(outputs))
        for output in outputs:
            self.exits.labels(str(output.record.exit_layer)).inc()
