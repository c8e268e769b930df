"""`Runtime`: one object a decode loop holds to take part in an exitplane fleet.

It owns a `ThresholdClient` (pull, verify, apply, cache, heartbeats) and a `TelemetryShipper`
(edge aggregation, shipping, disk spool), configured once from explicit arguments or from the
environment (`Runtime.from_env`). The loop reads the applied set (`thresholds`, `version`),
asks `should_shadow()` per token (at the shadow rate the control plane sets, else the local
`shadow_rate`) and `draw_shadow_request()` per request (whether to serve the whole request at
full depth as a shadow request: at the control plane's `shadow_request_rate`, else the local
one) and reports each token with `record(...)`; listeners hear of
new sets (`on_change`), refused ones (`on_refused`) and failures (`on_error`). A token file is
re-read when it changes, so a rotated token needs no restart. `offline_file` runs from a
threshold set file with no control plane at all. `close()` ships what is left and tells the
control plane the runtime left the fleet (docs/protocol.md, "Leave"). `verify`, `cert`,
`proxy`, `headers` and `transport` apply to every request it makes (`exitplane.client.http`).
"""

from __future__ import annotations

import logging
import os
import random
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import httpx

from exitplane.client.http import Cert, Verify, http_options
from exitplane.client.shipper import TelemetryShipper
from exitplane.client.thresholds import (
    RefusedThresholdSet,
    ThresholdClient,
    check_threshold_set,
    parse_threshold_set,
)
from exitplane.wire import (
    DEFAULT_SEGMENT,
    RUNTIME_ID_PATTERN,
    ShadowPoint,
    ThresholdSetWire,
    TokenRecord,
    check_runtime_id,
)

log = logging.getLogger("exitplane.client.runtime")

Apply = Callable[[ThresholdSetWire], None]
Listener = Callable[[Any], None]


class Runtime:
    """A runtime's link to its control plane; see the module docstring and docs/client.md."""

    def __init__(self, *, deployment: str, num_layers: int, exit_layers: Iterable[int],
                 runtime_id: str, url: str | None = None, token: str | None = None,
                 token_file: str | os.PathLike | None = None, apply: Apply | Any = None,
                 applies_segments: bool = False, shadow_rate: float = 0.0,
                 shadow_request_rate: float = 0.0,
                 shadow_request_rng: random.Random | None = None,
                 raw_sample_rate: float = 1.0, state_dir: str | os.PathLike = "exitplane-state",
                 offline_file: str | os.PathLike | None = None, head_digest: str | None = None,
                 model_revision: str | None = None, signal: str = "learned",
                 file_check_s: float = 5.0, leave_on_close: bool = True,
                 threshold_options: Mapping[str, Any] | None = None,
                 shipper_options: Mapping[str, Any] | None = None, verify: Verify = True,
                 cert: Cert | None = None, proxy: str | httpx.Proxy | None = None,
                 headers: Mapping[str, str] | None = None,
                 transport: httpx.BaseTransport | None = None):
        self.deployment = deployment
        self.runtime_id = check_runtime_id(runtime_id)
        self.num_layers = num_layers
        self.exit_layers = sorted(exit_layers)
        self.shadow_rate = shadow_rate  # the local rate (checked by the setter)
        self.shadow_request_rate = shadow_request_rate  # likewise
        self._shadow_request_rng = shadow_request_rng or random.Random()
        self.shadow_requests = 0  # requests drawn to be served as shadow requests
        self.applies_segments = applies_segments
        self.head_digest, self.model_revision = head_digest, model_revision
        self.leave_on_close = leave_on_close
        self.offline_file = Path(offline_file) if offline_file is not None else None
        self.token_file = Path(token_file) if token_file is not None else None
        if self.offline_file is None:
            if not url:
                raise ValueError("a Runtime needs the control plane's url, or offline_file")
            if token is None and self.token_file is None:
                raise ValueError("a Runtime needs a runtime token: token or token_file")
        self.url = url.rstrip("/") if url else None
        self._token = token if token is not None else (
            self._read_token() if self.token_file is not None else None)
        self._apply = _applier(apply)
        # checked and loaded once (CA bundle, client certificate), shared by every request
        self._http_options = http_options(verify=verify, cert=cert, proxy=proxy,
                                          headers=headers, transport=transport)
        self._listeners: dict[str, list[Listener]] = {"change": [], "refused": [], "error": []}
        self._shadow_sample = random.Random().random
        self.threshold_set: ThresholdSetWire | None = None
        self.dropped_offline = 0  # records seen while running from a file (not shipped)
        self._file_mtimes: dict[Path, float] = {}
        self._file_check_s = file_check_s
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._started = self._closed = False
        state = Path(state_dir)
        self.shipper: TelemetryShipper | None = None
        self.thresholds: ThresholdClient | None = None
        if self.offline_file is None:
            self.shipper = TelemetryShipper(
                base_url=self.url, token=self._token, deployment=deployment,
                runtime_id=self.runtime_id, num_layers=num_layers, exit_layers=self.exit_layers,
                spool_dir=state / "spool", raw_sample_rate=raw_sample_rate,
                head_digest=head_digest, model_revision=model_revision,
                **self._http_options, **dict(shipper_options or {}))
            self.thresholds = ThresholdClient(
                _Target(self), base_url=self.url, deployment=deployment, token=self._token,
                runtime_id=self.runtime_id, cache_path=state / "thresholds.json",
                conservative_signal=signal, telemetry=self.shipper, head_digest=head_digest,
                model_revision=model_revision,
                on_refused=lambda reason: self._emit("refused", reason),
                on_error=lambda problem: self._emit("error", problem),
                **self._http_options, **dict(threshold_options or {}))

    @classmethod
    def from_env(cls, **overrides: Any) -> Runtime:
        """Configure from EXITPLANE_* variables (docs/client.md lists them); keyword
        arguments win over the environment."""
        env = os.environ
        found: dict[str, Any] = {
            "url": env.get("EXITPLANE_URL"), "token": env.get("EXITPLANE_TOKEN"),
            "token_file": env.get("EXITPLANE_TOKEN_FILE"),
            "deployment": env.get("EXITPLANE_DEPLOYMENT"),
            "runtime_id": env.get("EXITPLANE_RUNTIME_ID") or default_runtime_id(),
            "state_dir": env.get("EXITPLANE_STATE_DIR"),
            "offline_file": env.get("EXITPLANE_THRESHOLDS_FILE"),
            "head_digest": env.get("EXITPLANE_HEAD_DIGEST"),
            "model_revision": env.get("EXITPLANE_MODEL_REVISION")}
        if env.get("EXITPLANE_NUM_LAYERS"):
            found["num_layers"] = _env_number("EXITPLANE_NUM_LAYERS", int)
        if env.get("EXITPLANE_EXIT_LAYERS"):
            found["exit_layers"] = [_parse_int("EXITPLANE_EXIT_LAYERS", part) for part
                                    in env["EXITPLANE_EXIT_LAYERS"].split(",") if part.strip()]
        for name in ("shadow_rate", "shadow_request_rate", "raw_sample_rate"):
            if env.get(f"EXITPLANE_{name.upper()}"):
                found[name] = _env_number(f"EXITPLANE_{name.upper()}", float)
        if found["token_file"]:
            found["token"] = None  # the file wins: it is the one that rotates
        found.update(_tls_from_env(env))
        options = {key: value for key, value in found.items() if value is not None}
        options.update(overrides)
        missing = [name for name in ("deployment", "num_layers", "exit_layers")
                   if name not in options]
        if missing:
            raise ValueError("Runtime.from_env needs " + ", ".join(
                f"EXITPLANE_{name.upper()}" for name in missing) + " (or the keyword)")
        return cls(**options)

    # -- listeners -------------------------------------------------------------------------
    def on_change(self, listener: Callable[[ThresholdSetWire], None]) -> Callable:
        """Call `listener(threshold_set)` after each new set is applied, and at once with
        the applied one when there is one (a decorator too)."""
        self._listeners["change"].append(listener)
        applied = self.threshold_set
        if applied is not None:
            try:
                listener(applied)
            except Exception:
                log.exception("on_change listener failed")
        return listener

    def on_refused(self, listener: Callable[[str], None]) -> Callable:
        """Call `listener(reason)` when a pulled set is refused (the current one stays)."""
        self._listeners["refused"].append(listener)
        return listener

    def on_error(self, listener: Callable[[str], None]) -> Callable:
        """Call `listener(problem)` when a pull, a file reload or the leave message fails."""
        self._listeners["error"].append(listener)
        return listener

    # -- life cycle ------------------------------------------------------------------------
    def start(self, ready_timeout: float | None = 30.0) -> Runtime:
        """Start pulling, shipping and watching files; wait until a set is applied."""
        if self._started:
            raise RuntimeError("this Runtime is already started")
        self._started = True
        if self.offline_file is not None:
            self._load_offline()
        else:
            self.shipper.start()
            self.thresholds.start()
            self.wait_ready(ready_timeout)
        if self.token_file is not None or self.offline_file is not None:
            self._remember_mtimes()
            self._watcher = threading.Thread(target=self._watch, name="exitplane-files",
                                             daemon=True)
            self._watcher.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until a set is applied (the control plane's, the cache's or never-exit)."""
        if self.thresholds is None:
            return self.threshold_set is not None
        return self.thresholds.wait_ready(timeout)

    def close(self, timeout: float = 30.0, *, leave: bool | None = None) -> None:
        """Ship (or spool) what is queued, stop, and tell the control plane this runtime left
        the fleet (`leave`, default `leave_on_close`)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout)
        if self.thresholds is None:
            return
        if self.token_file is not None:
            self._reload_token()  # the last sends and the leave go with the token held now
        self.shipper.close(timeout)
        self.thresholds.heartbeat()  # the last word on spooled and dropped counts
        leaving = self.leave_on_close if leave is None else leave
        if leaving and (problem := self.thresholds.leave()) is not None:
            self._emit("error", problem)
        self.thresholds.stop()

    def __enter__(self) -> Runtime:
        return self.start() if not self._started else self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the decode loop's side ------------------------------------------------------------
    @property
    def version(self) -> int | None:
        """The applied set's version (0: the built-in never-exit set); None before any."""
        return None if self.threshold_set is None else self.threshold_set.version

    def thresholds_for(self, segment: str | None = None) -> dict[int, float]:
        """Per-layer thresholds for a request of `segment` (its own map, else default's)."""
        applied = self.threshold_set
        if applied is None:
            raise RuntimeError("no threshold set applied yet: start() the Runtime first")
        return applied.for_segment(segment)

    @property
    def shadow_rate(self) -> float:
        """The shadow rate `should_shadow` applies: the control plane's when it sets one (the
        pulled configuration), else this runtime's own. Setting it sets this runtime's own."""
        pulled = self.thresholds.shadow_rate if self.thresholds is not None else None
        return self.local_shadow_rate if pulled is None else pulled

    @shadow_rate.setter
    def shadow_rate(self, rate: float) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"shadow_rate must be in [0, 1], not {rate!r}")
        self.local_shadow_rate = rate

    @property
    def shadow_rate_source(self) -> str:
        """Who set the applied shadow rate: `control_plane` or `local`."""
        pulled = self.thresholds.shadow_rate if self.thresholds is not None else None
        return "local" if pulled is None else "control_plane"

    def should_shadow(self) -> bool:
        """Whether to run this token to full depth as a shadow token (`shadow_rate`)."""
        rate = self.shadow_rate
        return rate > 0 and self._shadow_sample() < rate

    @property
    def shadow_request_rate(self) -> float:
        """The share of requests `draw_shadow_request` serves as shadow requests: the control
        plane's when it sets one, else this runtime's own. Setting it sets this runtime's own."""
        pulled = self.thresholds.shadow_request_rate if self.thresholds is not None else None
        return self.local_shadow_request_rate if pulled is None else pulled

    @shadow_request_rate.setter
    def shadow_request_rate(self, rate: float) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"shadow_request_rate must be in [0, 1], not {rate!r}")
        self.local_shadow_request_rate = rate

    @property
    def shadow_request_rate_source(self) -> str:
        """Who set the applied shadow-request rate: `control_plane` or `local`."""
        pulled = self.thresholds.shadow_request_rate if self.thresholds is not None else None
        return "local" if pulled is None else "control_plane"

    def draw_shadow_request(self) -> bool:
        """Whether to serve this request (greedily) entirely at full depth as a shadow
        request, at `shadow_request_rate`; ask once per request, when it arrives. Its tokens
        are then recorded with `shadow` points for every exit layer and `shadow_request=True`,
        the last one with `request_end=True` (docs/protocol.md, "Shadow requests")."""
        rate = self.shadow_request_rate
        drawn = rate > 0 and self._shadow_request_rng.random() < rate
        self.shadow_requests += drawn
        return drawn

    def exit_layer(self, signals: Mapping[int, float] | Callable[[int], float],
                   thresholds: Mapping[int, float]) -> tuple[int, float | None]:
        """(exit layer, signal at exit) under `thresholds`: the first exit layer whose signal
        is strictly greater than its threshold, else (num_layers, the last signal). A callable
        `signals(layer)` is asked only up to the exit."""
        signal = None
        for layer in self.exit_layers:
            signal = signals(layer) if callable(signals) else signals[layer]
            if signal > thresholds[layer]:
                return layer, signal
        return self.num_layers, signal

    def shadow(self, signals: Mapping[int, float],
               matched: Mapping[int, bool]) -> list[ShadowPoint]:
        """A shadow token's points: each exit layer's signal and whether its top-1 token
        equals full depth's."""
        return [ShadowPoint(layer=layer, signal=signals[layer], matched=bool(matched[layer]))
                for layer in self.exit_layers]

    def record(self, *, request_id: str, position: int, exit_layer: int,
               signal_value: float | None, latency_us: int = 0,
               shadow: list[ShadowPoint] | None = None, segment: str | None = None,
               threshold_version: int | None = None, ts: float | None = None,
               exit_checks: int | None = None, shadow_request: bool = False,
               request_end: bool = False) -> bool:
        """Report one token (never blocks). `threshold_version`: the set it was decided under
        (default: the applied one). A shadow token runs to full depth: its `exit_layer` is
        `num_layers` and its signal the one at the deepest exit layer. `latency_us` is the
        token's wall time and `exit_checks` the exit checks it computed: with both, the control
        plane counts it as timed and fits its cost model on it (None: served, not timed).
        A token of a shadow request says `shadow_request=True` (it is a shadow token too), and
        the request's last token `request_end=True`."""
        version = threshold_version if threshold_version is not None else (self.version or 0)
        token = TokenRecord(threshold_version=version, request_id=request_id,
                            position=position, exit_layer=exit_layer,
                            signal_value=signal_value, latency_us=latency_us,
                            ts=ts if ts is not None else time.time(), shadow=shadow,
                            segment=segment or DEFAULT_SEGMENT, exit_checks=exit_checks,
                            shadow_request=shadow_request, request_end=request_end)
        if self.shipper is None:
            self.dropped_offline += 1
            return False
        return self.shipper.submit(token)

    def heartbeat(self) -> bool:
        """Send a heartbeat now (one goes every 15 s and after each new set anyway)."""
        return self.thresholds.heartbeat() if self.thresholds is not None else False

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every token reported so far is delivered, refused or spooled."""
        return self.shipper.flush(timeout) if self.shipper is not None else True

    @property
    def metrics(self) -> dict[str, Any]:
        """The parts' counters and gauges, prefixed `thresholds_` and `telemetry_`."""
        found: dict[str, Any] = {"offline": int(self.offline_file is not None),
                                 "dropped_offline": self.dropped_offline,
                                 "shadow_rate": self.shadow_rate,
                                 "shadow_request_rate": self.shadow_request_rate,
                                 "shadow_requests": self.shadow_requests}
        for prefix, part in (("thresholds_", self.thresholds), ("telemetry_", self.shipper)):
            if part is not None:
                found.update({prefix + key: value for key, value in part.metrics.items()})
        return found

    # -- internals -------------------------------------------------------------------------
    def _applied(self, threshold_set: ThresholdSetWire) -> None:
        """The target's swap: the caller's `apply` first (a ValueError refuses the set)."""
        if self._apply is not None:
            self._apply(threshold_set)
        previous, self.threshold_set = self.threshold_set, threshold_set
        if previous is None or previous.checksum != threshold_set.checksum:
            self._emit("change", threshold_set)

    def _emit(self, kind: str, payload: Any) -> None:
        for listener in list(self._listeners[kind]):
            try:
                listener(payload)
            except Exception:
                log.exception("on_%s listener failed", kind)

    def _load_offline(self) -> None:
        try:
            wire = parse_threshold_set(self.offline_file.read_bytes())
            check_threshold_set(wire, deployment=self.deployment, exit_layers=self.exit_layers,
                                head_digest=self.head_digest)
            if wire.segments and not self.applies_segments:
                raise RefusedThresholdSet(f"set v{wire.version} has thresholds per segment; "
                                          "this runtime applies one map to every request")
            self._applied(wire)
        except OSError as exc:
            if self.threshold_set is None:
                raise
            self._emit("error", f"cannot read {self.offline_file}: {exc}")
        except (RefusedThresholdSet, ValueError) as exc:
            if self.threshold_set is None:
                raise RefusedThresholdSet(f"{self.offline_file}: {exc}") from exc
            log.error("refused threshold set file %s: %s", self.offline_file, exc)
            self._emit("refused", str(exc))

    def _read_token(self) -> str:
        token = self.token_file.read_text().strip()
        if not token:
            raise ValueError(f"the token file {self.token_file} is empty")
        return token

    def _watched(self) -> list[Path]:
        return [path for path in (self.token_file, self.offline_file) if path is not None]

    def _remember_mtimes(self) -> None:
        for path in self._watched():
            self._file_mtimes[path] = _mtime(path)

    def _watch(self) -> None:
        """Re-read the token file and the offline threshold file when they change."""
        while not self._stop.wait(self._file_check_s):
            for path in self._watched():
                mtime = _mtime(path)
                if mtime == self._file_mtimes.get(path):
                    continue
                self._file_mtimes[path] = mtime
                if path == self.offline_file:
                    self._load_offline()
                else:
                    self._reload_token()

    def _reload_token(self) -> None:
        try:
            token = self._read_token()
        except (OSError, ValueError) as exc:
            self._emit("error", f"cannot read the token file: {exc}; keeping the token")
            return
        if token != self._token:
            self._token = token
            for part in (self.thresholds, self.shipper):
                if part is not None:
                    part.set_token(token)
            log.info("runtime token reloaded from %s", self.token_file)


class _Target:
    """What the ThresholdClient drives: the Runtime's exit layers and its swap."""

    def __init__(self, runtime: Runtime) -> None:
        self.exit_layers = runtime.exit_layers
        self.applies_segments = runtime.applies_segments
        self.set_thresholds = runtime._applied


def _applier(apply: Apply | Any) -> Apply | None:
    """`apply` as a callable: a function as it is, an object's `set_thresholds`."""
    if apply is None or (callable(apply) and not hasattr(apply, "set_thresholds")):
        return apply
    if hasattr(apply, "set_thresholds"):
        return apply.set_thresholds
    raise TypeError("apply must be a callable taking a threshold set, or an object with "
                    f"set_thresholds(threshold_set); got {type(apply).__name__}")


def default_runtime_id() -> str:
    """This host's name, made to fit the runtime id pattern (stable across restarts)."""
    name = re.sub(r"[^A-Za-z0-9_.:-]", "-", socket.gethostname()).strip("-._:")[:128]
    name = name or "runtime"
    return name if re.fullmatch(RUNTIME_ID_PATTERN, name) else "runtime"


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime_ns / 1e9
    except OSError:
        return -1.0


def _tls_from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """`verify`, `cert` and `proxy` from EXITPLANE_CA_BUNDLE (a CA bundle file or directory),
    EXITPLANE_CLIENT_CERT and EXITPLANE_CLIENT_KEY (mutual TLS: the certificate, and its key
    when it is a file of its own) and EXITPLANE_PROXY (a proxy URL); unset ones are left out."""
    found: dict[str, Any] = {}
    if env.get("EXITPLANE_CA_BUNDLE"):
        found["verify"] = env["EXITPLANE_CA_BUNDLE"]
    if env.get("EXITPLANE_CLIENT_KEY") and not env.get("EXITPLANE_CLIENT_CERT"):
        raise ValueError("EXITPLANE_CLIENT_KEY needs EXITPLANE_CLIENT_CERT (the certificate "
                         "the key belongs to)")
    if env.get("EXITPLANE_CLIENT_CERT"):
        found["cert"] = (env["EXITPLANE_CLIENT_CERT"], env["EXITPLANE_CLIENT_KEY"]) \
            if env.get("EXITPLANE_CLIENT_KEY") else env["EXITPLANE_CLIENT_CERT"]
    if env.get("EXITPLANE_PROXY"):
        found["proxy"] = env["EXITPLANE_PROXY"]
    return found


def _parse_int(variable: str, text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"{variable}: {text!r} is not an integer") from None


def _env_number(variable: str, kind: type) -> Any:
    text = os.environ[variable]
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{variable}: {text!r} is not a number") from None
