"""What the runtime server holds while it serves (ServeState), and how it is wired up: the
engine thread, and the threshold client and telemetry shipper when a control plane is given.
The engine applies the shadow rate and the shadow-request rate the control plane sets, else its
own (`--shadow-rate`, `--shadow-request-rate`)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.serve_guard import DEFAULT_MAX_BODY_BYTES
from runtime.server_metrics import ServeMetrics
from runtime.serving.segments import DEFAULT_MAX_SEGMENTS, SegmentRouter, SegmentRules
from runtime.serving.worker import EngineWorker


@dataclass
class ServeState:
    """The engine, its worker thread, metrics, control-plane clients and serving limits."""

    engine: Any
    tokenizer: Any
    model_name: str
    worker: EngineWorker
    metrics: ServeMetrics
    thresholds: Any = None  # ThresholdClient, or None when a static set is applied
    shipper: Any = None
    default_max_tokens: int = 256
    shutdown_grace_s: float = 10.0
    accepting: bool = True
    api_keys: tuple[str, ...] = ()  # empty: /v1 is open (loopback or an internal network)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_chars: int = 32_768  # checked before tokenizing
    segments: SegmentRouter = field(default_factory=SegmentRouter)  # each request's segment
    # Tokenizing and detokenizing run here, never on the event loop: a huge prompt or a slow
    # decode must not stall every other stream. Prompts get their own pool so that a burst of
    # long prompts cannot queue in front of the per-token work of running streams.
    prompt_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        2, thread_name_prefix="exitplane-prompt"))
    text_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        2, thread_name_prefix="exitplane-text"))

    @property
    def ready(self) -> bool:
        client = self.thresholds
        # Ready once a set from the control plane or its cache is applied; the built-in
        # never-exit fallback serves, but is reported not ready.
        return self.accepting and (client is None or (client.ready and not client.degraded))


def shadow_rate_applier(config, name: str = "shadow_rate"):
    """The threshold client's `on_shadow_rate` (or, with `name="shadow_request_rate"`, its
    `on_shadow_request_rate`): the engine config's rate (read per step, or per request added)
    becomes the control plane's, or goes back to the configured one when the control plane
    sets none."""
    own = getattr(config, name)

    def apply(rate: float | None) -> None:
        setattr(config, name, own if rate is None else rate)
    return apply


def build_state(*, engine, tokenizer, model_name: str, control_plane: str | None,
                deployment: str | None, token: str | None, state_dir, max_queue: int = 64,
                static_thresholds=None, default_max_tokens: int = 256,
                shutdown_grace_s: float = 10.0, long_poll_s: float = 30.0,
                api_keys: tuple[str, ...] = (), max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                max_prompt_chars: int | None = None,
                stuck_after_s: float = 120.0,
                raw_sample_rate: float = 1.0, segment_rules: SegmentRules | None = None,
                max_segments: int = DEFAULT_MAX_SEGMENTS) -> ServeState:
    """Start the engine thread, and the threshold client and shipper when a control plane is
    given; with a static set instead, apply it and serve offline.

    max_prompt_chars defaults to 32 characters per token of the engine's max_seq_len: more
    than any real tokenizer packs, so only prompts that could never fit are refused unread.
    A step running longer than stuck_after_s turns /healthz to 503. Each request's segment
    comes from its header or body, else `segment_rules`; at most `max_segments` names besides
    `default` and the applied set's own, and without `api_keys` only those the set or the
    rules name (serving/segments.py)."""
    if segment_rules is not None:
        segment_rules.check_keys(api_keys)
    segments = SegmentRouter(rules=segment_rules, max_segments=max_segments,
                             set_segments=lambda: engine.policy.segments, keyed=bool(api_keys))
    metrics = ServeMetrics(engine.parts.num_layers, model_name)
    thresholds = shipper = None
    if control_plane:
        from exitplane.client.shipper import TelemetryShipper
        from exitplane.client.thresholds import ThresholdClient

        if not (deployment and token):
            raise ValueError("a control plane needs --deployment and --token-file")
        state_dir = Path(state_dir)
        shipper = TelemetryShipper(base_url=control_plane, token=token, deployment=deployment,
                                   runtime_id=engine.runtime_id,
                                   num_layers=engine.parts.num_layers,
                                   spool_dir=state_dir / "spool",
                                   exit_layers=engine.exit_layers,
                                   raw_sample_rate=raw_sample_rate,
                                   head_digest=engine.head_digest,
                                   model_revision=engine.model_revision).start()
        engine.on_record = shipper.submit
        thresholds = ThresholdClient(engine, base_url=control_plane, deployment=deployment,
                                     token=token, runtime_id=engine.runtime_id,
                                     cache_path=state_dir / "thresholds.json",
                                     long_poll_s=long_poll_s, telemetry=shipper,
                                     on_shadow_rate=shadow_rate_applier(engine.config),
                                     on_shadow_request_rate=shadow_rate_applier(
                                         engine.config, "shadow_request_rate")).start()
    elif static_thresholds is not None:
        engine.set_thresholds(static_thresholds)
    worker = EngineWorker(engine, max_queue=max_queue, metrics=metrics,
                          stuck_after_s=stuck_after_s)
    worker.start()
    return ServeState(engine=engine, tokenizer=tokenizer, model_name=model_name, worker=worker,
                      metrics=metrics, thresholds=thresholds, shipper=shipper,
                      default_max_tokens=default_max_tokens, shutdown_grace_s=shutdown_grace_s,
                      api_keys=tuple(api_keys), max_body_bytes=max_body_bytes,
                      segments=segments,
                      max_prompt_chars=max_prompt_chars or 32 * engine.config.max_seq_len)
