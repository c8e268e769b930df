"""Pull the deployment's threshold set from the control plane and keep the engine on it.

A background thread long-polls `GET /v1/deployments/{name}/thresholds` with the applied
set's ETag, verifies what comes back (schema, checksum, deployment, exit layers, the exit
heads it was made for), swaps
it into the running engine (`engine.set_thresholds`: a small object, nothing rebuilt), keeps a
local cache file of the last good set and heartbeats what it applies and serves (its model
revision and exit-heads digest: docs/protocol.md, "Lineage").

The pull says the runtime applies the control plane's shadow rate (`applies_shadow_rate`): the
answer carries the rate the control plane decided (`shadow_rate`, None while it sets none) and
an ETag that changes with it, so a new rate arrives by long-poll like a new set;
`on_shadow_rate(rate)` is called on each change (docs/protocol.md, "Shadow rate"). The share
of whole requests to serve as shadow requests (`shadow_request_rate`) arrives the same way,
with `on_shadow_request_rate(rate)` (docs/protocol.md, "Shadow requests").

Start-up without a control plane: the cached set if there is one, else the built-in
conservative set (version 0, never exits) with `degraded` set, a warning logged and the
`builtin_fallback` metric at 1. An invalid set is refused, the previous one stays, and the
reason goes into the next heartbeat. A failed pull is retried after the jittered backoff, or
after the `Retry-After` of a 429 or 503 (capped at the backoff maximum).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import httpx
from pydantic import ValidationError

from exitplane.client.files import atomic_write
from exitplane.client.http import http_client
from exitplane.client.retry import backoff_delay, retry_after
from exitplane.wire import (
    Heartbeat,
    Lineage,
    Signal,
    ThresholdPull,
    ThresholdSetWire,
    check_runtime_id,
    pull_etag,
)

log = logging.getLogger("exitplane.client.thresholds")

SOURCE_CONTROL_PLANE = "control_plane"
SOURCE_CACHE = "cache"
SOURCE_BUILTIN = "builtin"


class ThresholdTarget(Protocol):
    """What the client drives: the engine (exit layers and an atomic threshold swap).

    A target that applies per-segment thresholds per request says so with a true
    `applies_segments` attribute; a set with segments is refused by any other target, since
    it would apply `default`'s map to every segment, including one whose own map is stricter.
    """

    exit_layers: list[int]

    def set_thresholds(self, threshold_set: ThresholdSetWire) -> None: ...


class TelemetryStats(Protocol):
    """What a heartbeat reports about shipping (the telemetry shipper provides it)."""

    @property
    def spooled_batches(self) -> int: ...

    @property
    def dropped_records(self) -> int: ...


class RefusedThresholdSet(ValueError):
    """A pulled or cached threshold set that must not be applied; `version`: its version,
    where it is known (a body too broken to parse has none)."""

    version: int | None = None


def check_threshold_set(wire: ThresholdSetWire, *, deployment: str,
                        exit_layers: list[int], head_digest: str | None = None) -> None:
    """Raise RefusedThresholdSet unless `wire` is intact and fits this runtime exactly: its
    deployment, its exit layers and, when both name them, its exit heads (`head_digest`)."""
    try:
        wire.verify()
    except ValueError as exc:
        raise RefusedThresholdSet(str(exc)) from exc
    if wire.deployment != deployment:
        raise RefusedThresholdSet(f"set v{wire.version} is for deployment {wire.deployment!r}, "
                                  f"this runtime serves {deployment!r}")
    if not wire.fits_heads(head_digest):
        raise RefusedThresholdSet(
            f"set v{wire.version} was made for exit heads {wire.head_digest}; this runtime "
            f"serves heads {head_digest}: load the deployment's heads (or correct the "
            "deployment's head_digest)")
    got, want = sorted(wire.thresholds), sorted(exit_layers)
    if got != want:
        raise RefusedThresholdSet(f"set v{wire.version} has exit layers {got}; this runtime "
                                  f"exits at {want}")
    for segment, by_layer in (wire.segments or {}).items():
        if sorted(by_layer) != want:
            raise RefusedThresholdSet(f"set v{wire.version} segment {segment!r} has exit layers "
                                      f"{sorted(by_layer)}; this runtime exits at {want}")


def parse_threshold_set(body: bytes | str) -> ThresholdSetWire:
    """Validate the wire schema; a wrong type or missing field becomes RefusedThresholdSet."""
    return parse_pull(body).threshold_set()


def parse_pull(body: bytes | str) -> ThresholdPull:
    """Validate a pull answer (the set and the shadow rate); a wrong type or missing field
    becomes RefusedThresholdSet."""
    try:
        return ThresholdPull.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise RefusedThresholdSet(f"invalid threshold set: {where}: {first['msg']}") from exc


class ThresholdClient:
    """Keeps `engine` on its deployment's threshold set; see the module docstring."""

    def __init__(self, engine: ThresholdTarget, *, base_url: str, deployment: str, token: str,
                 runtime_id: str | None = None, cache_path: str | os.PathLike | None = None,
                 long_poll_s: float = 30.0, heartbeat_interval_s: float = 15.0,
                 backoff_initial_s: float = 0.5, backoff_max_s: float = 30.0,
                 request_timeout_s: float = 10.0, conservative_signal: Signal | str | None = None,
                 telemetry: TelemetryStats | None = None, head_digest: str | None = None,
                 model_revision: str | None = None,
                 on_refused: Callable[[str], None] | None = None,
                 on_error: Callable[[str], None] | None = None,
                 on_shadow_rate: Callable[[float | None], None] | None = None,
                 on_shadow_request_rate: Callable[[float | None], None] | None = None,
                 **http: Any):
        """`head_digest`, `model_revision`: what this runtime serves (default: the engine's
        `head_digest` and `model_revision` attributes; None: unknown, nothing is checked).
        `on_refused(reason)`: called on the pull thread for each set refused; `on_error(problem)`
        for each failed pull (control plane unreachable or answering an error);
        `on_shadow_rate(rate)` for each change of the shadow rate the control plane asks for
        (None: it asks none, the runtime's own applies), and `on_shadow_request_rate(rate)`
        likewise for the shadow-request rate. `http`: how
        requests reach the control plane (`verify`, `cert`, `proxy`, `headers`, `transport`:
        `exitplane.client.http`)."""
        self.engine = engine
        self.deployment = deployment
        self.runtime_id = runtime_id or getattr(engine, "runtime_id", None) or "runtime-0"
        check_runtime_id(self.runtime_id)
        # Checked here as the wire checks them: a bad value would get every heartbeat refused.
        self.lineage = Lineage(
            head_digest=head_digest or getattr(engine, "head_digest", None) or None,
            model_revision=model_revision or getattr(engine, "model_revision", None) or None)
        self.exit_layers = sorted(engine.exit_layers)
        self.cache_path = Path(cache_path) if cache_path is not None else None
        self.long_poll_s = long_poll_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.request_timeout_s = request_timeout_s
        policy = getattr(engine, "policy", None)
        self.conservative_signal = Signal(conservative_signal or getattr(policy, "signal", None)
                                          or Signal.learned)
        self.telemetry = telemetry
        self.on_refused, self.on_error = on_refused, on_error
        self.on_shadow_rate = on_shadow_rate
        self.on_shadow_request_rate = on_shadow_request_rate
        # The shadow rate and the shadow-request rate the control plane asks for (None: none,
        # or not heard yet)
        self.shadow_rate: float | None = None
        self.shadow_request_rate: float | None = None
        self._http = http_client(base_url=base_url, token=token, timeout=request_timeout_s,
                                 **http)
        self.applied: ThresholdSetWire | None = None
        self.source: str | None = None
        self.error: str | None = None
        # The version of the set refused last, while the refusal stands (heartbeats report it)
        self.refused_version: int | None = None
        self.counters = {"pulls": 0, "not_modified": 0, "applied": 0, "refused": 0,
                         "pull_errors": 0, "heartbeats": 0, "heartbeat_errors": 0,
                         "cache_write_errors": 0}
        self._started = threading.Event()  # the first set (any source) is applied
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beat_due = 0.0

    # -- public ----------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """A set is applied: the engine may serve (maybe on the conservative built-in set)."""
        return self.applied is not None

    @property
    def degraded(self) -> bool:
        """Serving the built-in never-exit set because neither control plane nor cache had one."""
        return self.source == SOURCE_BUILTIN

    @property
    def in_sync(self) -> bool:
        """Serving a set the control plane (or its cache) gave, with no refused set pending:
        what a heartbeat reports as `ready`."""
        return self.ready and not self.degraded and self.error is None

    @property
    def applied_version(self) -> int | None:
        return None if self.applied is None else self.applied.version

    def thresholds_for(self, segment: str | None) -> dict[int, float] | None:
        """Per-layer thresholds of the applied set for a request of `segment`: the segment's
        own map, or `default`'s for an unknown or missing segment; None before any set."""
        applied = self.applied
        return None if applied is None else applied.for_segment(segment)

    @property
    def metrics(self) -> dict[str, Any]:
        """Counters and gauges for scraping: pulls, refusals, degraded, applied version."""
        return {**self.counters, "ready": int(self.ready), "degraded": int(self.degraded),
                "builtin_fallback": int(self.degraded),
                "applied_version": -1 if self.applied is None else self.applied.version,
                "control_plane_shadow_rate": -1.0 if self.shadow_rate is None
                else self.shadow_rate,
                "control_plane_shadow_request_rate": -1.0 if self.shadow_request_rate is None
                else self.shadow_request_rate}

    def start(self) -> ThresholdClient:
        """Start the background pull/heartbeat thread."""
        if self._thread is not None:
            raise RuntimeError("the threshold client is already started")
        self._thread = threading.Thread(target=self._run, name="exitplane-thresholds",
                                        daemon=True)
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the first set is applied (control plane, cache or built-in)."""
        return self._started.wait(timeout) and self.ready

    def stop(self, timeout: float = 5.0) -> None:
        """Stop pulling. A long-poll in flight is abandoned (daemon thread, nothing applied)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self._http.close()

    def leave(self, timeout: float = 10.0) -> str | None:
        """Tell the control plane this runtime left the fleet (it drops out of the fleet view
        and of canary membership, and never turns into a `runtime_stale` alert). None when
        the control plane took it, else what went wrong (the runtime stops all the same)."""
        path = f"/v1/deployments/{self.deployment}/runtimes/{self.runtime_id}/leave"
        try:
            response = self._http.post(path, timeout=timeout)
        except httpx.HTTPError as exc:
            return f"could not leave the fleet: {exc}"
        if response.status_code != 200:
            return f"leaving the fleet answered {response.status_code}: {response.text[:300]}"
        log.info("runtime %s left deployment %s", self.runtime_id, self.deployment)
        return None

    def set_token(self, token: str) -> None:
        """Use `token` from the next request on (a rotated runtime token)."""
        self._http.headers["Authorization"] = f"Bearer {token}"

    def heartbeat(self) -> bool:
        """Send one heartbeat now; False when the control plane did not take it."""
        spooled = dropped = 0
        if self.telemetry is not None:
            spooled, dropped = self.telemetry.spooled_batches, self.telemetry.dropped_records
        applied = self.applied
        beat = Heartbeat(runtime_id=self.runtime_id,
                         model_revision=self.lineage.model_revision,
                         head_digest=self.lineage.head_digest,
                         applied_version=None if applied is None else applied.version,
                         applied_checksum=None if applied is None else applied.checksum,
                         ready=self.in_sync,
                         error=None if self.error is None
                         else self.error.replace("\x00", "")[:2000],
                         refused_version=self.refused_version,
                         spooled_batches=spooled, dropped_records=dropped)
        try:
            response = self._http.post(f"/v1/deployments/{self.deployment}/heartbeats",
                                       content=beat.model_dump_json(),
                                       headers={"Content-Type": "application/json"})
        except httpx.HTTPError as exc:
            self.counters["heartbeat_errors"] += 1
            log.debug("heartbeat failed: %s", exc)
            return False
        if response.status_code != 200:
            self.counters["heartbeat_errors"] += 1
            log.warning("heartbeat refused with %s: %s", response.status_code,
                        response.text[:300])
            return False
        self.counters["heartbeats"] += 1
        self._beat_due = time.monotonic() + self.heartbeat_interval_s
        return True

    # -- the loop --------------------------------------------------------------------------
    def _run(self) -> None:
        cached = self._load_cache()
        failures = 0
        first = True
        while not self._stop.is_set():
            etag = pull_etag(self.applied.checksum, self.shadow_rate,
                             self.shadow_request_rate) \
                if self.applied is not None else (
                    cached.checksum if cached is not None else None)
            wait = 0.0 if first else min(self.long_poll_s, self.heartbeat_interval_s)
            reached, changed, problem, refused = True, False, None, False
            told: float | None = None  # the wait a 429/503 asked for (Retry-After)
            try:
                changed = self._pull(etag, wait, cached if first else None)
            except httpx.HTTPError as exc:
                reached, problem = False, f"control plane unreachable: {exc}"
                self.counters["pull_errors"] += 1
            except _PullFailed as exc:
                problem, told = str(exc), exc.retry_after
                self.counters["pull_errors"] += 1
            except RefusedThresholdSet as exc:
                problem, refused = str(exc), True
                self._refuse(exc)
            except Exception as exc:  # keep the thread alive: the engine must keep a set
                log.exception("threshold client error")
                problem = f"internal error: {exc!r}"
                self.counters["pull_errors"] += 1
            if problem is None:
                failures = 0
            else:
                if not refused:
                    _notify(self.on_error, problem)
                if first:
                    self._fall_back(cached, problem)
                elif failures == 0 and not refused:
                    log.warning("%s; keeping threshold set v%s", problem, self.applied_version)
                failures += 1
            first = False
            if self._stop.is_set():
                break
            if reached and (changed or time.monotonic() >= self._beat_due):
                self.heartbeat()
            if failures:
                self._stop.wait(told if told is not None else backoff_delay(
                    failures - 1, self.backoff_initial_s, self.backoff_max_s))

    def _pull(self, etag: str | None, wait: float, cached: ThresholdSetWire | None) -> bool:
        """One GET; returns True when something new was applied."""
        params: dict[str, Any] = {"runtime_id": self.runtime_id, "applies_shadow_rate": "true",
                                  "applies_shadow_requests": "true"}
        headers = {}
        if etag is not None:
            headers["If-None-Match"] = f'"{etag}"'
            if wait > 0:
                params["wait"] = wait
        timeout = httpx.Timeout(self.request_timeout_s, read=wait + self.request_timeout_s)
        response = self._http.get(f"/v1/deployments/{self.deployment}/thresholds",
                                  params=params, headers=headers, timeout=timeout)
        self.counters["pulls"] += 1
        if self._stop.is_set():
            return False
        if response.status_code == 304:
            self.counters["not_modified"] += 1
            if self.applied is None and cached is not None:
                self._apply(cached, SOURCE_CONTROL_PLANE, write_cache=False)
                return True
            if self.source == SOURCE_CACHE:
                self.source = SOURCE_CONTROL_PLANE  # confirmed current
            return False
        if response.status_code != 200:
            detail = response.text[:300]
            if response.status_code in (401, 403):
                log.error("the control plane refused this runtime's token (%s): %s; check "
                          "the runtime token and its deployment", response.status_code, detail)
            wait_s = (retry_after(response, self.backoff_max_s)
                      if response.status_code in (429, 503) else None)
            raise _PullFailed(f"pull answered {response.status_code}: {detail}", wait_s)
        pulled = parse_pull(response.content)
        etag_header = response.headers.get("etag", "").removeprefix("W/").strip('"')
        if etag_header and etag_header != pull_etag(pulled.checksum, pulled.shadow_rate,
                                                    pulled.shadow_request_rate):
            raise RefusedThresholdSet(f"ETag {etag_header} does not match the body's checksum "
                                      f"and shadow rates for set v{pulled.version}")
        self._apply(pulled.threshold_set(), SOURCE_CONTROL_PLANE, write_cache=True)
        self._take_rate("shadow_rate", pulled.shadow_rate, self.on_shadow_rate)
        self._take_rate("shadow_request_rate", pulled.shadow_request_rate,
                        self.on_shadow_request_rate)
        return True

    def _take_rate(self, name: str, rate: float | None,
                   listener: Callable[[float | None], None] | None) -> None:
        """Keep a rate the control plane asks for (`shadow_rate`, `shadow_request_rate`) and
        tell its listener when it changed."""
        if rate == getattr(self, name):
            return
        setattr(self, name, rate)
        log.info("the control plane asks for %s %s", name.replace("_", " "),
                 "none (the runtime's own applies)" if rate is None else f"{rate:g}")
        if listener is not None:
            try:
                listener(rate)
            except Exception:
                log.exception("threshold client listener failed")

    def _apply(self, wire: ThresholdSetWire, source: str, *, write_cache: bool) -> None:
        try:
            check_threshold_set(wire, deployment=self.deployment, exit_layers=self.exit_layers,
                                head_digest=self.lineage.head_digest)
            if wire.segments and not getattr(self.engine, "applies_segments", False):
                names = ", ".join(sorted(wire.segments))
                raise RefusedThresholdSet(
                    f"set v{wire.version} has thresholds per segment ({names}); this runtime "
                    "applies one map to every request, so it keeps its set until it can apply "
                    "them (or a set without segments is published)")
            try:
                self.engine.set_thresholds(wire)
            except ValueError as exc:
                raise RefusedThresholdSet(f"engine refused set v{wire.version}: {exc}") from exc
        except RefusedThresholdSet as exc:
            exc.version = wire.version
            raise
        previous = self.applied
        self.applied, self.source = wire, source
        if source == SOURCE_CONTROL_PLANE:
            # a good set from the control plane clears a refusal
            self.error, self.refused_version = None, None
        self.counters["applied"] += 1
        if previous is None or previous.checksum != wire.checksum:
            log.info("applied threshold set v%d (%s, checksum %s) from %s", wire.version,
                     wire.signal, wire.checksum[:12], source)
        if write_cache and self.cache_path is not None:
            try:
                atomic_write(self.cache_path, wire.model_dump_json().encode())
            except OSError as exc:
                self.counters["cache_write_errors"] += 1
                log.warning("could not write the threshold cache %s: %s", self.cache_path, exc)
        self._started.set()

    def _refuse(self, exc: RefusedThresholdSet) -> None:
        self.counters["refused"] += 1
        kept = "nothing applied yet" if self.applied is None else \
            f"keeping v{self.applied.version}"
        self.error = f"refused threshold set: {exc}"
        self.refused_version = exc.version
        log.error("%s; %s", self.error, kept)
        self._beat_due = 0.0  # report it with the next heartbeat
        _notify(self.on_refused, str(exc))

    def _fall_back(self, cached: ThresholdSetWire | None, reason: str) -> None:
        """Start-up without a usable pull: the cached set, else the never-exit set."""
        if self.applied is not None:
            return
        if cached is not None:
            try:
                self._apply(cached, SOURCE_CACHE, write_cache=False)
            except RefusedThresholdSet as exc:
                log.warning("cannot use the cached threshold set: %s", exc)
            else:
                log.warning("%s; serving cached threshold set v%d from %s", reason,
                            cached.version, self.cache_path)
                return
        builtin = ThresholdSetWire.never_exit(deployment=self.deployment,
                                              signal=self.conservative_signal,
                                              exit_layers=self.exit_layers)
        log.warning("%s and no cached threshold set: running the built-in conservative set "
                    "(v0, never exits) in degraded mode until the control plane answers", reason)
        self._apply(builtin, SOURCE_BUILTIN, write_cache=False)

    def _load_cache(self) -> ThresholdSetWire | None:
        if self.cache_path is None or not self.cache_path.exists():
            return None
        try:
            wire = parse_threshold_set(self.cache_path.read_bytes())
            check_threshold_set(wire, deployment=self.deployment, exit_layers=self.exit_layers,
                                head_digest=self.lineage.head_digest)
        except (OSError, RefusedThresholdSet) as exc:
            log.warning("ignoring the threshold cache %s: %s", self.cache_path, exc)
            return None
        return wire


def _notify(listener: Callable[[str], None] | None, message: str) -> None:
    """Call a listener; what it raises is logged, never let into the pull loop."""
    if listener is None:
        return
    try:
        listener(message)
    except Exception:
        log.exception("threshold client listener failed")


class _PullFailed(Exception):
    """The control plane answered, but not with a set (auth, not found, server error);
    `retry_after`: the seconds a 429 or 503 asked the client to wait (None: back off)."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after
