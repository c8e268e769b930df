"""The control plane's settings: one pydantic-settings object, read once from EXITPLANE_* ."""

from __future__ import annotations

import ipaddress
import re
from functools import lru_cache
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from exitplane.wire import DEFAULT_MAX_SEGMENTS

HOST_NAME = re.compile(r"(?i)[a-z0-9_]([a-z0-9_-]{0,62})(\.[a-z0-9_]([a-z0-9_-]{0,62}))*\.?")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# A header name (RFC 9110 token) that is not one the HTTP stack or the UI's session relies on.
HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}")
RESERVED_HEADERS = frozenset({"host", "cookie", "authorization", "x-forwarded-for",
                              "content-type", "content-length", "origin"})
LOOPBACK_NAMES = frozenset({"localhost"})


def oidc_url_problem(url: str, allow_insecure_http: bool) -> str | None:
    """What is wrong with `url` as an OpenID Connect issuer or endpoint, or None: it must be
    https, or http on a loopback address when `allow_insecure_http`."""
    parts = urlsplit(url)
    if not parts.hostname or parts.scheme not in ("https", "http"):
        return f"{url!r} is not an http(s) URL"
    if parts.scheme == "http":
        if not allow_insecure_http:
            return f"{url!r} is not https (EXITPLANE_OIDC_ALLOW_INSECURE_HTTP allows http on " \
                   "a loopback address, for tests)"
        try:
            loopback = ipaddress.ip_address(parts.hostname).is_loopback
        except ValueError:
            loopback = parts.hostname.lower() in LOOPBACK_NAMES
        if not loopback:
            return f"{url!r} is plain http off loopback; the provider must use https"
    return None


def parse_networks(value: str) -> tuple[Network, ...]:
    """Comma-separated IP addresses and CIDR networks; ValueError names the first bad entry."""
    networks = []
    for entry in (part.strip() for part in value.split(",")):
        if not entry:
            continue
        try:
            networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
        except ValueError:
            raise ValueError(f"{entry!r} is neither an IP address nor a CIDR network") from None
    return tuple(networks)


class Settings(BaseSettings):
    """Everything the API, the workers and the CLI read from the environment."""

    # Neither a refusal at start-up nor a repr may print the values: URLs carry passwords.
    model_config = SettingsConfigDict(env_prefix="EXITPLANE_", extra="ignore",
                                      hide_input_in_errors=True)

    environment: Literal["embedded", "production"] = Field(
        default="embedded",
        description="`production` requires `EXITPLANE_SECRET_KEY`")
    var_dir: Path = Field(
        default=Path("var"),
        description="where the embedded SQLite file and local state live")
    database_url: str = Field(
        default="", repr=False,
        description="e.g. `postgresql+psycopg://user:pw@host/db`")
    redis_url: str = Field(
        default="", repr=False,
        description="Celery broker and telemetry stream in production")
    # Empty: a random key generated once under var_dir (controlplane/keys.py).
    secret_key: str = Field(
        default="", repr=False,
        description="signs UI sessions, encrypts hook credentials; in production and off loopback "
        "at least 32 characters and random (a repeated character, word or run like "
        "`abcd...` is refused)")
    host: str = Field(
        default="127.0.0.1",
        description="the address `exitplane up` listens on")
    port: int = Field(
        default=8000,
        description="the port `exitplane up` listens on")
    public_url: str = Field(
        default="",
        description="links in alerts")
    long_poll_max_s: float = Field(
        default=60.0, gt=0,
        description="cap on `?wait=`")
    # Long-polls one token may hold open at once on one API process (a runtime holds one);
    # past it a waiting pull is answered 429. 0: no cap.
    long_polls_per_token: int = Field(
        default=10_000, ge=0,
        description="long-polls one token may hold open at once on one API process (each runtime "
        "holds one); past it a waiting pull is answered 429 + `Retry-After`, so a "
        "leaked token cannot hold every socket the process has. Raise it when more "
        "runtimes than this share one token and one API process; 0: no cap")
    # An API process runs a full garbage collection every this many seconds instead
    # of Python's automatic ones (controlplane/collector.py); 0 keeps Python's policy.
    api_gc_full_interval_s: float = Field(
        default=60.0, ge=0,
        description="an API process runs a full garbage collection this often instead of Python's "
        "automatic ones, whose pauses otherwise show in the pull tail at fleet load "
        "(`controlplane/collector.py`); `0` keeps Python's policy")
    config_cache_ttl_s: float = Field(
        default=0.5, ge=0,
        description="how long an API process trusts its cached config; with Redis every alias move "
        "(any API process or worker) wakes long-polls at once, without it moves made by"
        " other processes are seen within this")
    # Hard maximum age of a cached token lookup: a revoked token stops working within it even
    # when the revocation notice is lost.
    token_cache_ttl_s: float = Field(
        default=2.0, ge=0,
        description="hard maximum age of a cached token check: a revoked token stops working within"
        " this even if the revocation notice is lost (with Redis every API process "
        "drops it at once; without, within `EXITPLANE_REVOCATION_POLL_S`); a busy "
        "process reads every active token again past half this age on a thread of its "
        "own, so requests do not wait for the read")
    max_body_bytes: int = Field(
        default=16 * 1024 * 1024, gt=0,
        description="larger telemetry batches (`/v1/telemetry`) get 413")
    log_level: str = Field(
        default="info",
        description="every process: API, ingest, worker, beat, runtime")
    # Per-token rate limits (shared through Redis when configured); 0 turns a limit off.
    rate_limit_pull_per_s: float = Field(
        default=50.0, ge=0,
        description="threshold pulls per second per token, bursts of twice that (0 = no limit); "
        "past it, 429 with `Retry-After`. With Redis one bucket per token is shared by "
        "every API process")
    rate_limit_ingest_per_s: float = Field(
        default=100.0, ge=0,
        description="telemetry posts per second per token, bursts of twice that (0 = no limit); "
        "past it, 429 with `Retry-After`. With Redis one bucket per token is shared by "
        "every API process")
    # Workers, drift detection and alerts.
    drift_interval_s: float = Field(
        default=30.0, gt=0,
        description="how often beat runs drift detection per deployment")
    drift_lookback_s: float = Field(
        default=1800.0, gt=0,
        description="seconds of rollups replayed for exit-rate drift")
    drift_recent_s: float = Field(
        default=600.0, gt=0,
        description="the window (seconds) for disagreement and distribution tests")
    alert_clear_after_s: float = Field(
        default=300.0, ge=0,
        description="an alert resolves once its condition stayed clear this long")
    runtime_stale_after_s: float = Field(
        default=120.0, gt=0,
        description="a runtime silent this long (or on an old version this long after a move) is "
        "stale")
    delivery_max_retries: int = Field(
        default=6, ge=0,
        description="how many times a failed hook delivery is retried")
    delivery_backoff_s: float = Field(
        default=2.0, ge=0,
        description="base of a hook delivery's jittered exponential backoff (seconds)")
    delivery_timeout_s: float = Field(
        default=10.0, gt=0,
        description="HTTP timeout of one hook delivery (seconds)")
    telemetry_retention_days: int = Field(
        default=14, ge=1,
        description="raw telemetry and rollups older than this are purged daily")
    report_max_bytes: int = Field(
        default=8 * 1024 * 1024, gt=0,
        description="largest Evidently drift report kept in the database, gzip-compressed "
        "(bytes); a larger one is not kept and its alert shows no report link")
    report_retention_days: int = Field(
        default=30, ge=1,
        description="Evidently drift reports older than this are dropped daily (the alert "
        "and its evidence stay)")
    # Recalibration, fallback and canary.
    calibration_min_samples: int = Field(
        default=1000, ge=1,
        description="shadow samples per exit layer a recalibration needs")
    # Shadow requests an answer target's test needs (deployments with delta_answer): fewer and
    # the job waits for more, as it waits for shadow samples.
    min_shadow_requests: int = Field(
        default=200, ge=1,
        description="complete shadow requests a recalibration of a deployment with an answer "
        "target (delta_answer) needs in its window (a segment's job: of its segment); fewer: "
        "the job waits for more and the current set stays")
    # A shadow request's tokens are assembled up to this many (telemetry/shadow_requests.py).
    shadow_request_max_tokens: int = Field(
        default=4096, ge=1, le=65536,
        description="tokens a shadow request may have; a longer one is not assembled (its "
        "tokens at later positions are not kept and the rest expire)")
    # Tokens of a shadow request still incomplete after this long are dropped.
    shadow_request_ttl_s: float = Field(
        default=3600.0, gt=0,
        description="seconds, counted from a staged shadow-request token's own timestamp "
        "(not its arrival), after which it is dropped if its request is still incomplete; a "
        "request missing a dropped token never completes, so keep it at least "
        "evidence_max_delay_s for spooled requests to complete")
    # Share of the calibration split that fits the threshold path (the rest tests it).
    calibration_learn_fraction: float = Field(
        default=0.3, gt=0, lt=1,
        description="share of the calibration split that fits the threshold path; the rest tests it"
        " (raise it when samples are few)")
    calibration_lookback_s: float = Field(
        default=86400.0, gt=0,
        description="default window of a manual recalibration")
    calibration_retry_s: float = Field(
        default=60.0, gt=0,
        description="how often a calibration job short of data (or, when automatic, of certifiable "
        "data) retries")
    calibration_wait_max_s: float = Field(
        default=3600.0, gt=0,
        description="how long a calibration job short of data (or, when automatic, of certifiable "
        "data) keeps retrying before it fails")
    operating_curve_interval_s: float = Field(
        default=300.0, gt=0,
        description="how often the workers redraw each deployment's operating curve, check it "
        "for an opportunity and queue the recalibrations a schedule makes due (seconds)")
    operating_curve_window_s: float = Field(
        default=3600.0, gt=0,
        description="the recent shadow evidence an operating curve is drawn from (seconds)")
    opportunity_min_gain: float = Field(
        default=0.10, gt=0,
        description="an opportunity re-tune needs the best certified set to save at least this "
        "much more net time than the active set, relative to what the active set saves (0.10: "
        "10% more), beyond sampling noise")
    opportunity_cooldown_s: float = Field(
        default=21600.0, ge=0,
        description="after an opportunity queued a recalibration, no other for the same "
        "deployment and segment for this long (seconds)")
    canary_interval_s: float = Field(
        default=60.0, gt=0,
        description="canary window length")
    canary_clean_windows: int = Field(
        default=3, ge=1,
        description="clean canary windows in a row that promote the canary")
    canary_failure_limit: int = Field(
        default=1, ge=1,
        description="failed canary windows that revert the canary")
    canary_max_inconclusive: int = Field(
        default=10, ge=1,
        description="inconclusive canary windows after which the canary pauses for a human")
    canary_min_shadow_tokens: int = Field(
        default=200, ge=1,
        description="fewer canary shadow tokens in a window is inconclusive")
    # The canary's quality test counts requests; fewer cannot show clustering
    canary_min_shadow_requests: int = Field(
        default=10, ge=2,
        description="fewer requests among a window's canary shadow tokens is inconclusive (the "
        "quality test counts requests)")
    # State shared across API processes: limits, revocation,
    # wake-ups and gauges go through Redis when configured, else the database / this process.
    revocation_poll_s: float = Field(
        default=0.5, gt=0,
        description="without Redis (on PostgreSQL), how often each API process reads the revocation"
        " epoch in the database")
    # Per token: a fleet sharing one token beats every 15 s, so 100/s serves ~1,500 runtimes.
    rate_limit_heartbeat_per_s: float = Field(
        default=100.0, ge=0,
        description="heartbeats per second per token, bursts of twice that (0 = no limit); past it,"
        " 429 with `Retry-After`. With Redis one bucket per token is shared by every "
        "API process")
    # Units per second per token on API reads (GET): a lookup takes 1, a read that scans
    # telemetry, logs or history takes 5 (controlplane/guards/policy.py: heavy); bursts of twice.
    rate_limit_read_per_s: float = Field(
        default=100.0, ge=0,
        description="units per second per token on API reads (`GET`), bursts of twice that (0 = no "
        "limit): a lookup takes 1, a read that scans telemetry, logs or history (or "
        "renders a report) takes 5, and a read owes one more unit per 10 ms it kept the "
        "API busy past that (a heavy read: per 2.5 ms); past it, 429 with `Retry-After`. "
        "Shared through Redis like the others; threshold pulls have their own limit")
    rate_limit_hold_s: float = Field(
        default=1.0, ge=0, le=10,
        description="a read, telemetry post or heartbeat refused past its token's rate (or a "
        "heartbeat of a new runtime past a runtime cap) is answered 429 (409) after waiting "
        "this long on the event loop (at most 256 at once per API "
        "process; no thread is held), with the `Retry-After` of when it came: a client that "
        "retries without waiting makes one request per connection per hold. 0: answered at "
        "once")
    max_runtimes_per_deployment: int = Field(
        default=5000, ge=1,
        description="runtimes (heard from within a day) a deployment accepts; a new one beyond gets"
        " 409")
    # Runtimes one token may have registered on a deployment (live ones): a token cannot take
    # the deployment's whole cap from the others.
    max_runtimes_per_token: int = Field(
        default=2000, ge=1,
        description="live runtimes one token may have registered on a deployment, so one token (a "
        "leaked one) cannot take the deployment's whole cap; a new one beyond gets 409."
        " Operators remove runtimes with `DELETE "
        "/v1/deployments/{name}/runtimes/{runtime_id}`")
    # A runtime never heard from again after its first beat stops counting against the caps
    # after this many seconds (instead of a day), and its row is removed then.
    runtime_single_beat_forget_s: float = Field(
        default=600.0, gt=0,
        description="a runtime not heard from again after its first heartbeat stops counting "
        "against the caps after this many seconds (not a day) and its row is removed")
    accelerator_hour_cost: float = Field(
        default=1.0, ge=0, allow_inf_nan=False,
        description="what one hour of accelerator time costs, in `accelerator_cost_unit`: "
        "the savings report time saved in it too")
    accelerator_cost_unit: str = Field(
        default="accelerator-hour", min_length=1, max_length=32,
        description="the label of `accelerator_hour_cost` in savings reports (a currency, or "
        "accelerator-hour when the cost is 1.0)")
    metrics_cache_ttl_s: float = Field(
        default=2.0, ge=0,
        description="how long the store-backed gauges on `/metrics` are reused between scrapes")
    metrics_token: str = Field(
        default="", repr=False,
        description="when set, `/metrics` needs `Authorization: Bearer <token>`")
    # Security: hooks may reach non-public addresses only when listed here
    # (comma-separated host names, IP addresses or CIDR networks, e.g. a local Alertmanager).
    hook_allowed_hosts: str = Field(
        default="",
        description="comma-separated host names, addresses or CIDR networks hooks may reach "
        "although not public (e.g. a local Alertmanager)")
    # Request bodies of every route but /v1/telemetry (which keeps max_body_bytes).
    max_control_body_bytes: int = Field(
        default=64 * 1024, gt=0,
        description="larger bodies on every other route get 413, before parsing")
    # Reverse proxies (comma-separated IP addresses or CIDR networks) whose X-Forwarded-For
    # names the client; from any other peer the header is ignored (controlplane/auth/clients.py).
    trusted_proxies: str = Field(
        default="",
        description="comma-separated addresses or CIDR networks of the reverse proxies in front of "
        "the API: only from them is `X-Forwarded-For` read (rightmost address that is "
        "not a trusted proxy) to find the client a sign-in is throttled by; from any "
        "other peer the header is ignored")
    # Password checks (argon2id, 19 MiB each) one API process runs at once; past it a sign-in
    # or password change is answered 429.
    password_checks_max_concurrent: int = Field(
        default=2, ge=1, le=64,
        description="password checks (argon2id, 19 MiB each) one API process runs at once; a "
        "sign-in or password change beyond them gets 429 with `Retry-After: 1`. Failed "
        "checks are also throttled per client address (IPv6: per /64), per username and"
        " per both, shared through Redis or the database")
    sign_in_hold_s: float = Field(
        default=5.0, ge=0, le=60,
        description="a sign-in or password change from a client address the throttle has "
        "locked out is refused before its form is read, after waiting this long (or what is "
        "left of the lock, if less) without holding a thread: a client that retries at once "
        "gets one answer per connection per hold. 0: refused at once")
    # Single sign-on to the admin UI (controlplane/auth/oidc.py, proxy.py, sso.py): an OpenID
    # Connect provider, and/or a trusted authenticating proxy's user and groups headers.
    oidc_issuer: str = Field(
        default="",
        description="the OpenID Connect provider's issuer URL (its discovery document is "
        "`<issuer>/.well-known/openid-configuration`), e.g. "
        "`https://keycloak.example.com/realms/ops`; set, the login page offers \"Sign in with "
        "<`EXITPLANE_OIDC_DISPLAY_NAME`>\" (authorization code flow with PKCE). https only, "
        "unless `EXITPLANE_OIDC_ALLOW_INSECURE_HTTP`. Empty: no OIDC sign-in")
    oidc_client_id: str = Field(
        default="",
        description="the client id registered at the OpenID Connect provider (its redirect URI: "
        "`<EXITPLANE_PUBLIC_URL>/ui/login/oidc/callback`); required with `EXITPLANE_OIDC_ISSUER`")
    oidc_client_secret: SecretStr = Field(
        default="", validate_default=True,
        description="the client's secret at the provider (sent to its token endpoint with HTTP "
        "Basic authentication); empty for a public client, which PKCE alone protects")
    oidc_scopes: str = Field(
        default="openid profile email",
        description="space-separated scopes asked for; must include `openid`. Add the one that "
        "puts `EXITPLANE_OIDC_ROLE_CLAIM` into the ID token where the provider needs one "
        "(e.g. `groups` for Dex or Okta)")
    oidc_username_claim: str = Field(
        default="preferred_username",
        description="the ID token claim whose value (lowercased) is the exitplane username of an "
        "OIDC user: 1-64 of `a-z 0-9 _ . @ -`; a value outside that is refused")
    oidc_role_claim: str = Field(
        default="groups",
        description="the ID token claim (a list of strings, or one string) whose values "
        "`EXITPLANE_SSO_ROLE_MAPPING` maps to roles, e.g. `groups` or `roles`")
    oidc_display_name: str = Field(
        default="single sign-on", min_length=1, max_length=60,
        description="the provider's name on the login page's button (\"Sign in with ...\")")
    oidc_allow_insecure_http: bool = Field(
        default=False,
        description="accept an `http://` issuer and endpoints on a loopback address (tests and "
        "a provider on the same host only); any other `http://` issuer is still refused")
    sso_role_mapping: dict[str, Literal["viewer", "operator", "admin"]] = Field(
        default={},
        description="JSON object from a group (an OIDC role-claim value or a proxy groups-header "
        "entry) to an exitplane role, e.g. `{\"ops-admins\": \"admin\", \"ops\": "
        "\"operator\"}`; a user in several mapped groups gets the strongest role. Applied at "
        "every SSO sign-in")
    sso_default_role: Literal["", "viewer", "operator", "admin"] = Field(
        default="",
        description="the role of an SSO user none of whose groups is mapped; empty: such a user "
        "is refused")
    proxy_user_header: str = Field(
        default="",
        description="with `EXITPLANE_TRUSTED_PROXIES`, the header (e.g. `X-Forwarded-User`) "
        "through which an authenticating proxy names the signed-in user: a UI request whose "
        "connection comes from a trusted proxy is signed in as that user. From any other "
        "peer the header is ignored (and logged). The proxy must drop the header from what "
        "clients send. Empty: no header sign-in")
    proxy_groups_header: str = Field(
        default="",
        description="the header (e.g. `X-Forwarded-Groups`) with the proxy-authenticated user's "
        "groups, comma-separated, mapped to a role by `EXITPLANE_SSO_ROLE_MAPPING`. Empty: "
        "header users get `EXITPLANE_SSO_DEFAULT_ROLE`")

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

    @field_validator("trusted_proxies")
    @classmethod
    def _trusted_proxies_are_networks(cls, value: str) -> str:
        try:
            parse_networks(value)
        except ValueError as error:
            raise ValueError(f"EXITPLANE_TRUSTED_PROXIES: {error}") from None
        return value

    @model_validator(mode="after")
    def _single_sign_on_is_complete(self) -> Settings:
        if self.oidc_issuer:
            problem = oidc_url_problem(self.oidc_issuer, self.oidc_allow_insecure_http)
            if problem:
                raise ValueError(f"EXITPLANE_OIDC_ISSUER: {problem}")
            if not self.oidc_client_id:
                raise ValueError("EXITPLANE_OIDC_ISSUER is set but EXITPLANE_OIDC_CLIENT_ID is "
                                 "empty: set the client id registered at the provider")
            if "openid" not in self.oidc_scopes.split():
                raise ValueError("EXITPLANE_OIDC_SCOPES must include `openid`")
        for name in ("proxy_user_header", "proxy_groups_header"):
            header = getattr(self, name)
            if header and (not HEADER_NAME.fullmatch(header)
                           or header.lower() in RESERVED_HEADERS):
                raise ValueError(f"EXITPLANE_{name.upper()}: {header!r} is not a header a proxy "
                                 "may sign users in with")
        if self.proxy_user_header and not self.trusted_proxies.strip():
            raise ValueError("EXITPLANE_PROXY_USER_HEADER needs EXITPLANE_TRUSTED_PROXIES: the "
                             "addresses of the proxies whose header is believed")
        return self
    # Operability: one log shape for every process (exitplane/kit/logs.py reads the
    # same variables in processes without these settings), the access log, worker metrics.
    log_format: Literal["json", "text"] | None = Field(
        default=None,
        description="one line a record; JSON carries `request_id`, `process_name`, `logger`, "
        "`level`")
    access_log: bool | None = Field(
        default=None,
        description="one `exitplane.access` line per HTTP request (method, route, status, duration,"
        " request id)")
    worker_metrics_port: int = Field(
        default=0, ge=0, le=65535,
        description="a Celery worker (task durations and failures) or an ingest worker (ingested "
        "and duplicate batches, stream lag) serves its metrics on this port")
    heartbeat_file: Path | None = Field(
        default=None,
        description="a Celery worker, ingest worker or beat writes here, from its own loop, the "
        "time by which it will be back; `python -m exitplane.kit.liveness FILE` (a liveness "
        "probe) fails once that time has passed. Unset: no heartbeat")
    # The ingest worker lowers its CPU priority to this nice value at start.
    # Its work is throughput that the Redis stream buffers; on a host it shares with an API
    # process, the pulls and posts runtimes wait for go first. 0 keeps the inherited priority.
    ingest_nice: int = Field(
        default=10, ge=0, le=19,
        description="the nice value an ingest worker lowers itself to at start (0: keep the "
        "inherited one): its work is throughput the Redis stream buffers, so on a host "
        "it shares with an API process the pulls and posts runtimes wait for go first")
    # Drift on clustered traffic and a fallback that follows quality evidence.
    # Design effect of exit-rate tests when the window's shadow tokens cannot measure it.
    drift_default_design_effect: float = Field(
        default=1.0, ge=1.0,
        description="exit-rate tests' design effect when the window's shadow requests cannot "
        "measure it")
    # Distribution drift alone is info; it pages once it held this many consecutive windows.
    drift_distribution_persist_windows: int = Field(
        default=3, ge=1,
        description="distribution drift alone pages after this many consecutive windows")
    drift_distribution_p_value: float = Field(
        default=1e-3, gt=0, lt=1,
        description="the level of the distribution two-sample tests")
    # The quality test's sliding windows (seconds, each at most
    # drift_recent_s) and the false-alarm budget per hour that all their looks share.
    drift_quality_windows_s: list[float] = Field(
        default=[60.0, 180.0, 600.0], min_length=1,
        description="sliding windows (seconds, each at most the recent window) on which every check"
        " tests shadow disagreement against δ")
    drift_quality_alpha_per_hour: float = Field(
        default=1e-2, gt=0, lt=1,
        description="false-alarm budget per hour shared by all quality looks (each window of each "
        "check is tested at this × interval / 3600 / windows)")
    # A check reads at most this many of a segment's newest shadow tokens (a
    # fleet ships ~10,000 a second; past the cap the windows hold their newest tokens).
    drift_max_shadow_tokens: int = Field(
        default=100_000, ge=1000,
        description="newest shadow tokens a check reads per segment; at fleet rates (~10,000/s) the"
        " windows then hold their newest tokens, and the alert's evidence says where a "
        "capped window begins")
    # The answer watch (controlplane/drift/answers.py) tests a segment's recent complete shadow
    # requests only from this many on; fewer: the answer check is not made (nothing fires or
    # clears).
    drift_answer_min_requests: int = Field(
        default=20, ge=1,
        description="complete shadow requests of the recent window a segment needs before the "
        "drift check tests its answers against delta_answer (answer_regression)")
    # An exit-rate spike falls back unless the (1 - alpha) upper bound of the window's
    # request-clustered shadow disagreement is within δ on enough shadow tokens and requests.
    fallback_gate_alpha: float = Field(
        default=0.05, gt=0, lt=1,
        description="an exit-rate spike keeps the set only when the (1-alpha) upper bound of shadow"
        " disagreement is within δ: this alpha")
    fallback_min_shadow_tokens: int = Field(
        default=200, ge=1,
        description="shadow tokens an exit-rate spike's window needs before its disagreement bound "
        "can keep the set")
    fallback_min_shadow_requests: int = Field(
        default=20, ge=1,
        description="shadow requests an exit-rate spike's window needs before its disagreement "
        "bound can keep the set")
    # An exit-rate tumbling window closes after this many minutes of rollups
    # (once it holds enough tokens for its test) when its 5,000 tokens take longer.
    drift_exit_rate_window_min: int = Field(
        default=5, ge=1,
        description="an exit-rate tumbling window (5,000 tokens) is also tested after this many "
        "minutes of rollups, once it holds the tokens its test needs: thin traffic gets"
        " a timely exit-rate alert")
    # Robust evidence (controlplane/stats/robust_evidence.py): the most of a verdict's shadow
    # tokens one witness may hold, as a share and as a multiple of the median witness's
    # (past either its requests are subsampled), and from how many witnesses on every verdict
    # (calibration step, quality regression, exit-rate spike or collapse, canary) must hold
    # with any single witness's evidence left out.
    evidence_max_runtime_share: float = Field(
        default=0.5, gt=0, le=1,
        description="the largest share of a calibration's shadow tokens one runtime may hold "
        "(from evidence_robust_min_runtimes reporting runtimes up); a runtime over it keeps a "
        "random subset of its requests up to it")
    evidence_robust_min_runtimes: int = Field(
        default=3, ge=2,
        description="in a window with at least this many reporting witnesses (runtime tokens: "
        "the runtime ids of one token are one witness), every calibration step, quality "
        "regression, exit-rate spike or collapse and canary verdict must hold with any single "
        "witness's evidence left out (no witness decides alone), and calibration caps each "
        "witness's share of the shadow tokens; with fewer, a canary pauses for an operator "
        "instead of promoting, and a first calibration from never-exit waits for approval")
    # 2x: at the smallest robust fleet (three) a flooder beside two typical witnesses keeps
    # half the tokens, as the share cap allows; in larger fleets it keeps less (a third of
    # five), and an honest witness with up to twice the typical traffic loses nothing.
    evidence_max_share_of_median: float = Field(
        default=2.0, ge=1,
        description="from evidence_robust_min_runtimes witnesses up, the most shadow tokens one "
        "witness may keep in a calibration, as a multiple of the median witness's count; a "
        "witness over it keeps a random subset of its requests up to it")
    evidence_max_delay_s: float = Field(
        default=3600.0, gt=0,
        description="a shadow token a runtime token posted more than this many seconds after "
        "its own timestamp is stored and shown but never counts as evidence (calibration, "
        "drift, canary): backdated evidence cannot slip into a past window; raise it for "
        "runtimes that spool longer through an outage")
    # A runtime is tested against the rest of its fleet each drift cycle once it and the rest
    # have at least this many shadow requests in the window (controlplane/drift/outliers.py).
    outlier_min_requests: int = Field(
        default=5, ge=2,
        description="shadow requests a runtime (and the rest of its fleet) needs in the drift "
        "window before it is tested as a possible outlier (`runtime_outlier`: set aside"
        " until an operator clears it)")
    # Bounds on automatic promotion (controlplane/calibration/promotion.py): a candidate that
    # lowers a threshold by more than this step, or raises the expected exit rate by more than
    # this, waits for approval whatever the policy.
    promotion_max_threshold_step: float = Field(
        default=0.75, gt=0, le=1,
        description="a recalibrated set that lowers any threshold the active set exits on by more "
        "than this step waits for approval whatever the policy; with a single reporting "
        "runtime, a set more aggressive than the last good one always waits")
    promotion_max_exit_rate_rise: float = Field(
        default=0.9, gt=0, le=1,
        description="a recalibrated set that raises the expected exit rate by more than this waits "
        "for approval whatever the policy; with a single reporting runtime, a set more "
        "aggressive than the last good one always waits")
    # Traffic segments: how many segments (besides `default`) a deployment has in use
    # and one threshold set may map; bounds the segment label's cardinality. A telemetry batch
    # may carry at most twice as many distinct names, and `default` (more: 422).
    max_segments_per_deployment: int = Field(
        default=DEFAULT_MAX_SEGMENTS, ge=1, le=1000,
        description="traffic segments (besides `default`) a deployment has in use: operators "
        "declare and remove them (`exitplane segment`, the API, the UI; publishing a "
        "set that maps one declares it), and telemetry registers names only where the "
        "deployment opted in (`auto_segments`); traffic of any other name is stored as "
        "`default` (counted in `exitplane_segment_overflow_tokens_total{deployment}` "
        "and on the UI's segments page); a declaration or set past the cap gets 422, "
        "and so does a telemetry batch carrying more than twice as many distinct names "
        "(and `default`); runtimes read it to cap the names they track")
    # Telemetry POSTs and heartbeats answered below the
    # router by a pure-ASGI layer with the routes' checks; false serves them through FastAPI.
    telemetry_fast_path: bool = Field(
        default=True,
        description="telemetry POSTs and heartbeats are answered below the router with the routes' "
        "own checks (auth, rate limit, scope, errors); `false` serves them through "
        "FastAPI")
    # Worker threads the fast path may use per API process, apart from the pool the routes
    # use: a burst of telemetry never queues a pull, an alias move or a UI page behind it.
    telemetry_threads: int = Field(
        default=16, ge=1, le=256,
        description="worker threads per API process for telemetry POSTs and heartbeats, apart from "
        "the routes' pool, so a burst of telemetry never queues a pull's token lookup, "
        "an alias move or a UI page")
    # A beat from a runtime this API process has recorded is held and written with the others
    # every this many seconds (controlplane/runtimes/beats.py); 0 writes each beat at once.
    heartbeat_flush_s: float = Field(
        default=1.0, ge=0, le=60,
        description="a heartbeat from a runtime this API process has already recorded is answered "
        "at once and written with the others in one statement this often (never over a "
        "newer stored beat; the process's runtime listing writes them first); 0 writes "
        "each beat in its own transaction")
    # A telemetry batch whose tokens are timed more than this many seconds past the API's
    # clock is refused (422): a runtime with a clock gone wrong. 0 turns the check off.
    telemetry_max_future_s: float = Field(
        default=600.0, ge=0,
        description="a telemetry batch with a token timed (`ts`, or a cell's `minute`) more than "
        "this many seconds after the API's clock is refused with 422 naming it: a "
        "runtime whose clock runs ahead would put its tokens where no drift window, "
        "gauge or canary looks; 0 turns the check off. Timestamps in the past are taken"
        " (spooled batches arrive late)")
    # Values one telemetry batch may decode to (every number, string, list and map counts
    # one), counted while decoding, so a small body cannot expand past it: over it is 413,
    # and the runtime splits the batch. Bounds a decode's memory (about 100 bytes a value).
    telemetry_max_batch_items: int = Field(
        default=1_000_000, ge=10_000,
        description="values (numbers, strings, lists, maps) one telemetry batch may decode to, "
        "counted while it is decoded: a batch over it gets 413 and the runtime splits "
        "it, so no body expands past about 100 MiB")
    # Telemetry bodies over 32 KiB (or of unknown length) one API process reads and decodes
    # at once; past it such a batch is answered 429 with Retry-After, before its body is read.
    telemetry_max_decodes: int = Field(
        default=2, ge=1, le=64,
        description="telemetry bodies over 32 KiB (or of unknown length) one API process reads and "
        "decodes at once; another gets 429 with `Retry-After: 1` before its body is "
        "read (the token and its rate limit are checked first, from the headers alone)")
    # Memory those decodes may hold together per API process: each is charged twice its
    # body's bytes when admitted and about 100 bytes a value as it decodes (controlplane/
    # guards/budgets.py: DecodeBudget), so decode memory is bounded whatever the bodies hold.
    telemetry_decode_budget_mib: int = Field(
        default=48, ge=4, le=16384,
        description="memory (MiB) the telemetry bodies over 32 KiB that one API process is "
        "decoding may hold together: each is charged twice its body's length when it "
        "arrives (before it is read) and 100 bytes for each value as it is decoded. A "
        "batch that does not fit while others hold part of it gets 429 with "
        "`Retry-After: 1`; one that alone needs more than all of it gets 413, and the "
        "runtime splits it. Keep it at least twice `EXITPLANE_MAX_BODY_BYTES`")

    @model_validator(mode="after")
    def _refuse_weak_secret_in_production(self) -> Settings:
        # Production replicas need one shared key, so it is never generated there.
        if self.environment == "production" and len(self.secret_key) < 32:
            raise ValueError("EXITPLANE_SECRET_KEY must be at least 32 characters (random) in "
                             "production, e.g. export EXITPLANE_SECRET_KEY=\"$(python -c "
                             "'import secrets; print(secrets.token_urlsafe(48))')\"")
        if self.environment == "production":
            from controlplane.keys import MAKE_ONE, randomness_problem

            problem = randomness_problem(self.secret_key)
            if problem:
                raise ValueError(f"{problem}, which is not enough in production: set it to a "
                                 "random value, e.g. export "
                                 f"EXITPLANE_SECRET_KEY=\"$({MAKE_ONE})\"")
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
