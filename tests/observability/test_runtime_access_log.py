"""The runtime server's access log and request ids, on a real uvicorn port: the caller's
X-Request-ID comes back (a malformed one is replaced), one `exitplane.access` line per request
carries it with the route, status and duration, a streamed answer's line is written when the
stream ends, and a request the guard refuses has its line too."""

from __future__ import annotations

import logging

import httpx
import pytest

from tests.support.runtime_server import served_on_a_port, tiny_state
from tests.support.waiting import wait_until


@pytest.fixture
def served(monkeypatch):
    monkeypatch.delenv("EXITPLANE_ACCESS_LOG", raising=False)  # on by default in a runtime
    state = tiny_state(api_keys={"sk-test"})
    with served_on_a_port(state, api_key="sk-test") as served:
        yield served


def _access(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "exitplane.access"]


def test_the_request_id_comes_back_and_stamps_the_access_line(served, caplog):
    caplog.set_level(logging.INFO)
    auth = {"Authorization": "Bearer sk-test"}
    answer = httpx.post(f"{served.url}/v1/completions", headers={**auth, "X-Request-ID": "rq-7"},
                        json={"prompt": "abc", "max_tokens": 4}, timeout=60)
    assert answer.status_code == 200 and answer.headers["x-request-id"] == "rq-7"
    [line] = wait_until(lambda: [r for r in _access(caplog) if r.request_id == "rq-7"], 10,
                        "the access line")
    assert (line.method, line.path, line.route, line.status) == (
        "POST", "/v1/completions", "/v1/completions", 200)
    assert line.duration_ms > 0

    bad = httpx.get(f"{served.url}/v1/models", headers={**auth, "X-Request-ID": "no\tgood"})
    assert bad.headers["x-request-id"] != "no\tgood" and len(bad.headers["x-request-id"]) == 32


def test_a_streamed_answer_is_logged_when_it_ends_and_a_refused_one_too(served, caplog):
    caplog.set_level(logging.INFO)
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", timeout=60,
                      headers={"Authorization": "Bearer sk-test", "X-Request-ID": "rq-stream"},
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                            "stream": True}) as stream:
        assert stream.headers["x-request-id"] == "rq-stream"
        body = "".join(stream.iter_text())
    assert body.rstrip().endswith("data: [DONE]")
    # written by the server once the last chunk is sent, which the client may read first
    [line] = wait_until(lambda: [r for r in _access(caplog) if r.request_id == "rq-stream"], 10,
                        "the streamed request's access line")
    assert line.status == 200 and line.route == "/v1/chat/completions"

    refused = httpx.post(f"{served.url}/v1/completions", json={"prompt": "x"},
                         headers={"X-Request-ID": "rq-nokey"})
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "rq-nokey"
    [line] = wait_until(lambda: [r for r in _access(caplog) if r.request_id == "rq-nokey"], 10,
                        "the refused request's access line")
    assert line.status == 401
