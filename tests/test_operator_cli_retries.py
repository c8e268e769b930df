"""An operator command's read refused for its token's rate (429) is asked again after its
Retry-After, as a well-behaved client does; a wait too long for a command is one line with exit
status 1. Against a stand-in HTTP server that refuses as the control plane does."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from click.testing import CliRunner

from exitplane.cli import main
from exitplane.ops.api import READ_RETRIES


class Refusing(BaseHTTPRequestHandler):
    """Answers GETs with 429 (Retry-After from the server's `retry_after`) `refusals` times,
    then with an empty list of deployments."""

    def do_GET(self) -> None:
        server = self.server
        server.asked += 1
        if server.asked <= server.refusals:
            body, code = {"detail": "too many reads for this token"}, 429
        else:
            body, code = [], 200
        data = json.dumps(body).encode()
        self.send_response(code)
        if code == 429:
            self.send_header("Retry-After", server.retry_after)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_args) -> None:
        pass


@pytest.fixture
def refusing():
    servers = []

    def start(refusals: int, retry_after: str) -> ThreadingHTTPServer:
        server = ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
        server.asked, server.refusals, server.retry_after = 0, refusals, retry_after
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _list(server) -> object:
    url = f"http://127.0.0.1:{server.server_address[1]}"
    return CliRunner(env={"EXITPLANE_URL": url, "EXITPLANE_TOKEN": "ept_test",
                          "EXITPLANE_OUTPUT": "json"}).invoke(
        main, ["deployments", "list"], catch_exceptions=False)


def test_a_read_refused_for_its_rate_is_asked_again_after_retry_after(refusing):
    server = refusing(refusals=2, retry_after="0")
    result = _list(server)
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout) == [] and server.asked == 3


def test_a_refusal_past_the_retries_or_with_a_long_wait_is_one_line(refusing):
    always = refusing(refusals=100, retry_after="0")
    result = _list(always)
    assert result.exit_code == 1 and always.asked == READ_RETRIES + 1
    assert result.stderr.startswith("exitplane: ") and "HTTP 429" in result.stderr
    long_wait = refusing(refusals=100, retry_after="600")
    result = _list(long_wait)
    assert result.exit_code == 1 and long_wait.asked == 1  # not held for ten minutes
    assert result.stderr.count("\n") == 1
