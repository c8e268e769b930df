"""The control plane's settings: one pydantic-settings object, read once from EXITPLANE_* ."""

from __future__ import annotations

import ipaddress
import re
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from exitplane.wire import DEFAULT_MAX_SEGMENTS

HOST_NAME = re.compile(r"(?i)[a-z0-9_]([a-z0-9_-]{0,62})(\.[a-z0-9_]([a-z0-9_-]{0,62}))*\.?")


class Settings(BaseSettings):
    """Everything the API, the workers and the CLI read from the environment."""

    # Neither a refusal at start-up nor a repr may print the values: URLs carry passwords.
    model_config = SettingsConfigDict(env_prefix="EXITPLANE_", extra="ignore",
                                      hide_input_in_errors=True)

    environment: Literal["embedded", "production"] = "embedded"
    var_dir: Path = Path("var")
    database_url: str = Field(default="", repr=False)
    redis_url: str = Field(default="", repr=False)
    # Empty: a random key generated once under var_dir (controlplane/keys.py, issue 13).
    secret_key: str = Field(default="", repr=False)
    host: str = "127.0.0.1"
    port: int = 8000
    public_url: str = ""
    long_poll_max_s: float = Field(default=60.0, gt=0)
    # Long-polls one token may hold open at once on one API process (a runtime holds one);
    # past it a waiting pull is answered 429. 0: no cap.
    long_polls_per_token: int = Field(default=10_000, ge=0)
    # Issue 14: an API process runs a full garbage collection every this many seconds instead
    # of Python's automatic ones (controlplane/collector.py); 0 keeps Python's policy.
    api_gc_full_interval_s: float = Field(default=60.0, ge=0)
    config_cache_ttl_s: float = Field(default=0.5, ge=0)
    # Hard maximum age of a cached token lookup: a revoked token stops working within it even
    # when the revocation notice is lost.
    token_cache_ttl_s: float = Field(default=2.0, ge=0)
    max_body_bytes: int = Field(default=16 * 1024 * 1024, gt=0)
    log_level: str = "info"
    # Per-token rate limits (shared through Redis when configured); 0 turns a limit off.
    rate_limit_pull_per_s: float = Field(default=50.0, ge=0)
    rate_limit_ingest_per_s: float = Field(default=100.0, ge=0)
    # Workers, drift detection and alerts (issue 5).
    drift_interval_s: float = Field(default=30.0, gt=0)
    drift_lookback_s: float = Field(default=1800.0, gt=0)
    drift_recent_s: float = Field(default=600.0, gt=0)
    alert_clear_after_s: float = Field(default=300.0, ge=0)
    runtime_stale_after_s: float = Field(default=120.0, gt=0)
    delivery_max_retries: int = Field(default=6, ge=0)
    delivery_backoff_s: float = Field(default=2.0, ge=0)
    delivery_timeout_s: float = Field(default=10.0, gt=0)
    telemetry_retention_days: int = Field(default=14, ge=1)
    # Recalibration, fallback and canary (issue 6).
    calibration_min_samples: int = Field(default=1000, ge=1)
    # Share of the calibration split that fits the threshold path (the rest tests it).
    calibration_learn_fraction: float = Field(default=0.3, gt=0, lt=1)
    calibration_lookback_s: float = Field(default=86400.0, gt=0)
    calibration_retry_s: float = Field(default=60.0, gt=0)
    calibration_wait_max_s: float = Field(default=3600.0, gt=0)
    canary_interval_s: float = Field(default=60.0, gt=0)
    canary_clean_windows: int = Field(default=3, ge=1)
    canary_failure_limit: int = Field(default=1, ge=1)
    canary_max_inconclusive: int = Field(default=10, ge=1)
    canary_min_shadow_tokens: int = Field(default=200, ge=1)
    # issue 17: the canary's quality test counts requests; fewer cannot show clustering
    canary_min_shadow_requests: int = Field(default=10, ge=2)
    # State shared across API processes (issues 13.4/13.6/13.7/13.8, 14.4): limits, revocation,
    # wake-ups and gauges go through Redis when configured, else the database / this process.
    revocation_poll_s: float = Field(default=0.5, gt=0)
    # Per token: a fleet sharing one token beats every 15 s, so 100/s serves ~1,500 runtimes.
    rate_limit_heartbeat_per_s: float = Field(default=100.0, ge=0)
    max_runtimes_per_deployment: int = Field(default=5000, ge=1)
    metrics_cache_ttl_s: float = Field(default=2.0, ge=0)
    metrics_token: str = Field(default="", repr=False)
    # Security (issue 13): hooks may reach non-public addresses only when listed here
    # (comma-separated host names, IP addresses or CIDR networks, e.g. a local Alertmanager).
    hook_allowed_hosts: str = ""
    # Request bodies of every route but /v1/telemetry (which keeps max_body_bytes).
    max_control_body_bytes: int = Field(default=64 * 1024, gt=0)

    @field_validator("hook_allowed_hosts")
    @classmethod
    def _allowed_hosts_are_hosts_or_networks(cls, value: str) -> str:
        for entry in (part.strip() for part in value.split(",")):
            if not entry:
                continue
            try:
                ipaddress.ip_network(entry.strip("[]"), strict=False)
            except ValueError:
                if not HOST_NAME.fullmatch(entry):
                    raise ValueError(f"EXITPLANE_HOOK_ALLOWED_HOSTS: {entry!r} is neither a host "
                                     "name, an IP address nor a CIDR network") from None
        return value
    # Operability (issue 15): one log shape for every process (exitplane/logs.py reads the
    # same variables in processes without these settings), the access log, worker metrics.
    log_format: Literal["json", "text"] | None = None
    access_log: bool | None = None
    worker_metrics_port: int = Field(default=0, ge=0, le=65535)
    # Issue 14 (fleet): the ingest worker lowers its CPU priority to this nice value at start.
    # Its work is throughput that the Redis stream buffers; on a host it shares with an API
    # process, the pulls and posts runtimes wait for go first. 0 keeps the inherited priority.
    ingest_nice: int = Field(default=10, ge=0, le=19)
    # Drift on clustered traffic and a fallback that follows quality evidence (issue 17).
    # Design effect of exit-rate tests when the window's shadow tokens cannot measure it.
    drift_default_design_effect: float = Field(default=1.0, ge=1.0)
    # Distribution drift alone is info; it pages once it held this many consecutive windows.
    drift_distribution_persist_windows: int = Field(default=3, ge=1)
    drift_distribution_p_value: float = Field(default=1e-3, gt=0, lt=1)
    # issue 17 detection speed: the quality test's sliding windows (seconds, each at most
    # drift_recent_s) and the false-alarm budget per hour that all their looks share.
    drift_quality_windows_s: list[float] = Field(default=[60.0, 180.0, 600.0], min_length=1)
    drift_quality_alpha_per_hour: float = Field(default=1e-2, gt=0, lt=1)
    # issue 14 (fleet): a check reads at most this many of a segment's newest shadow tokens (a
    # fleet ships ~10,000 a second; past the cap the windows hold their newest tokens).
    drift_max_shadow_tokens: int = Field(default=100_000, ge=1000)
    # An exit-rate spike falls back unless the (1 - alpha) upper bound of the window's
    # request-clustered shadow disagreement is within δ on enough shadow tokens and requests.
    fallback_gate_alpha: float = Field(default=0.05, gt=0, lt=1)
    fallback_min_shadow_tokens: int = Field(default=200, ge=1)
    fallback_min_shadow_requests: int = Field(default=20, ge=1)
    # issue 18 point 5: an exit-rate tumbling window closes after this many minutes of rollups
    # (once it holds enough tokens for its test) when its 5,000 tokens take longer.
    drift_exit_rate_window_min: int = Field(default=5, ge=1)
    # Traffic segments (issue 18): how many segments (besides `default`) one threshold set may
    # give thresholds of their own; bounds the segment label's cardinality.
    max_segments_per_deployment: int = Field(default=DEFAULT_MAX_SEGMENTS, ge=1, le=1000)
    # Issue 14 (fleet cost per request): telemetry POSTs and heartbeats answered below the
    # router by a pure-ASGI layer with the routes' checks; false serves them through FastAPI.
    telemetry_fast_path: bool = True
    # Worker threads the fast path may use per API process, apart from the pool the routes
    # use: a burst of telemetry never queues a pull, an alias move or a UI page behind it.
    telemetry_threads: int = Field(default=16, ge=1, le=256)
    # A beat from a runtime this API process has recorded is held and written with the others
    # every this many seconds (controlplane/runtimes/beats.py); 0 writes each beat at once.
    heartbeat_flush_s: float = Field(default=1.0, ge=0, le=60)
    # A telemetry batch whose tokens are timed more than this many seconds past the API's
    # clock is refused (422): a runtime with a clock gone wrong. 0 turns the check off.
    telemetry_max_future_s: float = Field(default=600.0, ge=0)

    @model_validator(mode="after")
    def _refuse_weak_secret_in_production(self) -> Settings:
        # Production replicas need one shared key, so it is never generated there.
        if self.environment == "production" and len(self.secret_key) < 32:
            raise ValueError("EXITPLANE_SECRET_KEY must be at least 32 characters (random) in "
                             "production, e.g. export EXITPLANE_SECRET_KEY=\"$(python -c "
                             "'import secrets; print(secrets.token_urlsafe(48))')\"")
        return self

    @property
    def effective_database_url(self) -> str:
        """The configured URL, or the embedded SQLite file under var_dir."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.var_dir / 'exitplane.db').resolve()}"

    @property
    def base_url(self) -> str:
        return self.public_url or f"http://{self.host}:{self.port}"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once."""
    return Settings()
