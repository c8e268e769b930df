"""The threshold client against the real control plane over HTTP: pull, 304, long-poll,
refusal of tampered sets, the cache file and the built-in conservative set."""

from __future__ import annotations

import json
import logging
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from exitplane.client.thresholds import ThresholdClient
from exitplane.wire import ThresholdSetWire, threshold_checksum
from tests.support.network import serve_in_thread
from tests.support.runtime_link import DEPLOYMENT, EXIT_LAYERS, publish
from tests.support.waiting import patient_get, wait_until

pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)

FAST = {"backoff_initial_s": 0.05, "backoff_max_s": 0.5, "request_timeout_s": 10.0}


def _client(engine, url, token, **kwargs) -> ThresholdClient:
    options = {"long_poll_s": 1.0, "heartbeat_interval_s": 1.0, **FAST, **kwargs}
    return ThresholdClient(engine, base_url=url, deployment=DEPLOYMENT, token=token, **options)


def _runtime_row(operator: httpx.Client, runtime_id: str) -> dict | None:
    rows = patient_get(operator, f"/v1/deployments/{DEPLOYMENT}/runtimes").json()
    return next((row for row in rows if row["runtime_id"] == runtime_id), None)


def test_pulls_applies_caches_heartbeats_and_304_keeps_the_set(
        control_plane, operator, runtime_token, make_engine, tmp_path):
    version = publish(operator, {2: 0.9, 4: 0.8})
    engine = make_engine(runtime_id="rt-pull")
    cache = tmp_path / "thresholds.json"
    client = _client(engine, control_plane.url, runtime_token, cache_path=cache,
                     long_poll_s=0.2, heartbeat_interval_s=0.2).start()
    try:
        assert client.wait_ready(20)
        assert engine.policy.version == version == 2
        assert engine.policy.thresholds == {2: 0.9, 4: 0.8}
        assert client.source == "control_plane" and not client.degraded
        cached = ThresholdSetWire.model_validate_json(cache.read_bytes())
        assert cached == client.applied and cached.checksum == engine.policy.checksum

        policy = engine.policy
        wait_until(lambda: client.counters["not_modified"] >= 3, message="three 304s")
        assert engine.policy is policy  # a 304 swaps nothing
        assert client.counters["applied"] == 1

        wait_until(lambda: (_runtime_row(operator, "rt-pull") or {}).get("applied_version") == 2,
                   message="a heartbeat with v2")
        row = _runtime_row(operator, "rt-pull")
        assert row["ready"] is True and row["error"] is None
        assert row["applied_checksum"] == client.applied.checksum

        engine.generate([[1, 5, 7, 9]], max_new_tokens=3)
        assert {r.threshold_version for r in engine.drain_records()} == {2}
    finally:
        client.stop()


def test_long_poll_picks_up_an_alias_move_at_once(control_plane, operator, runtime_token,
                                                  make_engine):
    engine = make_engine(runtime_id="rt-long")
    client = _client(engine, control_plane.url, runtime_token, long_poll_s=20,
                     heartbeat_interval_s=20).start()
    try:
        assert client.wait_ready(20) and engine.policy.version == 1
        version = publish(operator, {2: 0.5, 4: 0.4})
        wait_until(lambda: engine.policy.version == version, timeout=15,
                   message="the long-poll to deliver the new set")
        # One plain pull, then the long-poll that the move answered: no interval polling.
        assert client.counters["pulls"] == 2 and client.counters["not_modified"] == 0
        moved = operator.put(f"/v1/deployments/{DEPLOYMENT}/aliases/active",
                             json={"version": 1, "reason": "back"})
        assert moved.status_code == 200
        wait_until(lambda: engine.policy.version == 1, timeout=15, message="the rollback")
        assert client.counters["pulls"] == 3
    finally:
        client.stop(timeout=0.5)  # a long-poll in flight is abandoned, not waited for


class TamperingProxy:
    """Forwards to the real control plane; while `mode` is set, damages served sets."""

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.mode: str | None = None
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                proxy.forward(self)

            def do_POST(self):
                proxy.forward(self)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = serve_in_thread(self.server)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def forward(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        headers = {k: v for k, v in handler.headers.items()
                   if k.lower() in ("authorization", "if-none-match", "content-type")}
        response = httpx.request(handler.command, self.upstream + handler.path, headers=headers,
                                 content=body, timeout=60)
        content, etag = response.content, response.headers.get("etag")
        if self.mode and "/thresholds" in handler.path and response.status_code == 200:
            content, etag = self.tamper(content, etag)
        handler.send_response(response.status_code)
        handler.send_header("Content-Type", response.headers.get("content-type", "text/plain"))
        if etag:
            handler.send_header("ETag", etag)
        handler.send_header("Content-Length", str(len(content)))
        handler.end_headers()
        handler.wfile.write(content)

    def tamper(self, content: bytes, etag: str | None) -> tuple[bytes, str | None]:
        wire = json.loads(content)
        if self.mode == "checksum":
            wire["thresholds"]["2"] = 0.0  # the content changes, the checksum does not
        elif self.mode == "missing_layer":
            del wire["thresholds"]["4"]  # intact checksum, but not this runtime's layers
            wire["checksum"] = threshold_checksum(
                deployment=wire["deployment"], version=wire["version"], signal=wire["signal"],
                thresholds={int(k): v for k, v in wire["thresholds"].items()})
            etag = f'"{wire["checksum"]}"'
        elif self.mode == "wrong_type":
            wire["thresholds"]["2"] = "aggressive"
        return json.dumps(wire).encode(), etag

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize(("mode", "reason"), [
    ("checksum", "checksum mismatch"),
    ("missing_layer", "has exit layers [2]"),
    ("wrong_type", "thresholds.2"),
])
def test_a_tampered_set_is_refused_the_previous_stays_and_the_heartbeat_says_why(
        control_plane, operator, runtime_token, make_engine, tmp_path, mode, reason):
    publish(operator, {2: 0.9, 4: 0.8})
    proxy = TamperingProxy(control_plane.url)
    engine = make_engine(runtime_id="rt-tamper")
    cache = tmp_path / "thresholds.json"
    client = _client(engine, proxy.url, runtime_token, cache_path=cache)
    client.start()
    try:
        assert client.wait_ready(20) and engine.policy.version == 2
        good_cache = cache.read_bytes()
        proxy.mode = mode
        publish(operator, {2: 0.3, 4: 0.2})
        wait_until(lambda: client.counters["refused"] >= 1, message="a refusal")
        assert engine.policy.version == 2 and engine.policy.thresholds == {2: 0.9, 4: 0.8}
        assert cache.read_bytes() == good_cache  # the cache keeps the last good set
        wait_until(lambda: reason in ((_runtime_row(operator, "rt-tamper") or {}).get("error")
                                      or ""), message="the refusal in a heartbeat")
        row = _runtime_row(operator, "rt-tamper")
        assert row["applied_version"] == 2 and row["ready"] is False

        proxy.mode = None
        wait_until(lambda: engine.policy.version == 3, message="the intact set")
        wait_until(lambda: (_runtime_row(operator, "rt-tamper") or {}).get("error") is None,
                   message="the error to clear")
        assert _runtime_row(operator, "rt-tamper")["applied_version"] == 3
    finally:
        client.stop()
        proxy.close()


def test_the_cache_serves_when_the_control_plane_is_down_at_start(
        control_plane, operator, runtime_token, make_engine, tmp_path):
    publish(operator, {2: 0.9, 4: 0.8})
    cache = tmp_path / "thresholds.json"
    first = _client(make_engine(runtime_id="rt-cache"), control_plane.url, runtime_token,
                    cache_path=cache).start()
    assert first.wait_ready(20) and first.applied.version == 2
    first.stop()
    control_plane.stop()

    engine = make_engine(runtime_id="rt-cache")
    client = _client(engine, control_plane.url, runtime_token, cache_path=cache).start()
    try:
        assert client.wait_ready(20)
        assert client.source == "cache" and not client.degraded
        assert engine.policy.version == 2 and engine.policy.thresholds == {2: 0.9, 4: 0.8}
        assert client.counters["pull_errors"] >= 1
        engine.generate([[3, 4, 5]], max_new_tokens=2)  # it serves on the cached set

        control_plane.start()
        publish(operator, {2: 0.6, 4: 0.5})
        wait_until(lambda: engine.policy.version == 3, message="the new set after restart")
        assert client.source == "control_plane"
    finally:
        client.stop()


@pytest.mark.parametrize("cache_state", ["absent", "tampered"])
def test_no_cache_and_no_control_plane_runs_the_conservative_set_degraded(
        control_plane, operator, runtime_token, make_engine, tmp_path, caplog, cache_state):
    cache = tmp_path / "thresholds.json"
    if cache_state == "tampered":
        wire = ThresholdSetWire.build(deployment=DEPLOYMENT, version=5, signal="maxprob",
                                      thresholds={2: 0.9, 4: 0.9})
        cache.write_text(wire.model_dump_json().replace("0.9", "0.1"))
    control_plane.stop()
    engine = make_engine(runtime_id="rt-degraded")
    client = _client(engine, control_plane.url, runtime_token, cache_path=cache)
    with caplog.at_level(logging.WARNING, logger="exitplane.client.thresholds"):
        client.start()
        try:
            assert client.wait_ready(20)
            assert client.degraded and client.source == "builtin"
            assert client.metrics["builtin_fallback"] == 1 and client.metrics["degraded"] == 1
            assert engine.policy.version == 0
            assert engine.policy.thresholds == dict.fromkeys(EXIT_LAYERS, 1.0)
            assert "built-in conservative set" in caplog.text
            if cache_state == "tampered":
                assert "ignoring the threshold cache" in caplog.text

            control_plane.start()
            wait_until(lambda: not client.degraded, message="the control plane's set")
            assert engine.policy.version == 1 and client.metrics["builtin_fallback"] == 0
            wait_until(lambda: (_runtime_row(operator, "rt-degraded") or {}).get("ready"),
                       message="a ready heartbeat")
            assert ThresholdSetWire.model_validate_json(cache.read_bytes()).version == 1
        finally:
            client.stop()


def test_a_runtime_id_the_control_plane_would_refuse_is_refused_at_once(
        control_plane, runtime_token, make_engine):
    engine = make_engine(runtime_id="rt-ok")
    for bad in ("my runtime", "<rt>", "x" * 129):
        with pytest.raises(ValueError, match="must match"):
            _client(engine, control_plane.url, runtime_token, runtime_id=bad)
    assert _client(engine, control_plane.url, runtime_token, runtime_id="gpu-7.pod:3").runtime_id
