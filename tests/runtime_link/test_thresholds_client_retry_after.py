"""The threshold client waits as long as a 429 or 503 pull answer's Retry-After asks (capped
at its backoff maximum) instead of its own short backoff (docs/protocol.md, "Pull")."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from exitplane.client.thresholds import ThresholdClient
from tests.support.network import serve_in_thread
from tests.support.runtime_link import DEPLOYMENT
from tests.support.waiting import wait_until


class RefusingHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        server = self.server
        with server.lock:
            server.pulls.append(time.monotonic())
        body = b'{"detail": "busy"}'
        self.send_response(server.status)
        self.send_header("Retry-After", server.retry_after)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # heartbeats: a client that never pulled a set sends none
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


class Refusing(ThreadingHTTPServer):
    """Answers every pull with `status` and `Retry-After: retry_after`; notes when."""

    def __init__(self, status: int, retry_after: str) -> None:
        self.status, self.retry_after = status, retry_after
        self.pulls: list[float] = []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), RefusingHandler)
        serve_in_thread(self)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def _pull_gaps(engine, status: int, retry_after: str, *, backoff_max_s: float,
               pulls: int) -> list[float]:
    """Seconds between the client's pulls while every pull is refused; checks it kept the
    built-in conservative set meanwhile."""
    server = Refusing(status, retry_after)
    client = ThresholdClient(engine, base_url=server.url, deployment=DEPLOYMENT, token="t",
                             long_poll_s=1.0, heartbeat_interval_s=60.0,
                             backoff_initial_s=0.02, backoff_max_s=backoff_max_s).start()
    try:
        # the server notes a pull before it answers, the client counts the error after: wait
        # for both, or a stop between the two loses the last count
        wait_until(lambda: len(server.pulls) >= pulls
                   and client.counters["pull_errors"] >= pulls,
                   timeout=30, message=f"{pulls} refused pulls, seen and counted")
    finally:
        client.stop()
        server.shutdown()
    assert client.counters["pull_errors"] >= pulls
    assert client.applied_version == 0  # it serves the built-in conservative set meanwhile
    return [b - a for a, b in zip(server.pulls, server.pulls[1:], strict=False)]


@pytest.mark.parametrize("status", [429, 503])
def test_a_pull_refused_with_retry_after_waits_that_long(make_engine, status):
    gaps = _pull_gaps(make_engine(runtime_id="rt-busy"), status, "0.6", backoff_max_s=5.0,
                      pulls=4)
    # Its own backoff would have pulled again after 10-20 ms, then 20-40 ms, ...
    assert min(gaps) >= 0.55, gaps


def test_a_huge_retry_after_is_capped_at_the_backoff_maximum(make_engine):
    # a day's wait would never bring a second pull; the cap (0.5 s) brings three
    gaps = _pull_gaps(make_engine(runtime_id="rt-capped"), 503, "86400", backoff_max_s=0.5,
                      pulls=3)
    assert min(gaps) >= 0.45, gaps
