"""Body limits: control routes do not read megabytes before auth. Every route
but /v1/telemetry takes kilobytes (EXITPLANE_MAX_CONTROL_BODY_BYTES, 64 KiB), enforced in an
ASGI middleware before any parsing: a declared Content-Length is refused at once and a chunked
body is counted as it streams, so the answer comes before the client has finished sending."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

MB = 1024 * 1024
CHUNK = 64 * 1024


def _chunked_request(path: str, port: int, sent_bytes: int,
                     content_type: str = "application/json", token: str = "") -> bytes:
    """Headers and the first `sent_bytes` of a chunked body that would be 5 MB (the rest is
    never sent): whatever answers has not waited for, nor parsed, the whole body."""
    authorization = f"Authorization: Bearer {token}\r\n" if token else ""
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{authorization}"
            f"Content-Type: {content_type}\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    chunk = b"[" + b"1," * (CHUNK // 2 - 1) + b"1"
    body = b"".join(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
                    for _ in range(sent_bytes // len(chunk)))
    return head + body


def _answer(port: int, request: bytes) -> tuple[int, dict]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        connection.sendall(request)
        received = b""
        while b"\r\n\r\n" not in received:
            received += connection.recv(65536)
        head, _, body = received.partition(b"\r\n\r\n")
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(body) < length:
            body += connection.recv(65536)
    return int(head.split()[1]), json.loads(body)


@pytest.mark.parametrize(("path", "content_type"), [
    ("/v1/deployments", "application/json"), ("/v1/hooks", "application/json"),
    ("/v1/tokens", "application/json"), ("/v1/deployments/chat/heartbeats", "application/json"),
    ("/ui/login", "application/x-www-form-urlencoded")])
def test_a_streamed_body_is_refused_before_it_is_read_in_full(live_server, tokens, path,
                                                              content_type):
    port = int(live_server.url.rsplit(":", 1)[1])
    # Heartbeats check the token before they read a byte of the body (without one: 401,
    # tests/security/test_telemetry_bounds.py); with one, the body is counted as it is read.
    token = tokens.operator if path.endswith("/heartbeats") else ""
    # 320 KiB of a 5 MB body, then silence: only a limit checked while streaming answers.
    status, body = _answer(port, _chunked_request(path, port, 5 * CHUNK, content_type, token))
    assert status == 413
    assert "exceeds the limit of 65536 bytes" in body["detail"]


def test_a_declared_length_is_refused_at_once(live_server):
    # Content-Length says 5 MB and nothing follows: refused on the headers alone.
    port = int(live_server.url.rsplit(":", 1)[1])
    request = (f"POST /v1/deployments HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {5 * MB}\r\n\r\n").encode()
    status, body = _answer(port, request)
    assert status == 413 and f"{5 * MB} bytes exceeds the limit of 65536" in body["detail"]


def test_a_whole_5mb_body_gets_413_not_a_parse(live_server, tokens):
    admin = tokens.headers(tokens.admin)
    big = b'{"name": "' + b"x" * (5 * MB) + b'"}'

    def stream():
        for start in range(0, len(big), CHUNK):
            yield big[start:start + CHUNK]

    with httpx.Client(timeout=30) as client:
        chunked = client.post(f"{live_server.url}/v1/deployments", headers=admin,
                              content=stream())
        assert chunked.status_code == 413, chunked.text
        declared = client.post(f"{live_server.url}/v1/deployments", headers=admin, content=big)
        assert declared.status_code == 413
        # Ordinary control requests and telemetry batches beyond 64 KiB still pass the gate.
        small = client.post(f"{live_server.url}/v1/deployments", headers=admin,
                            json={"name": "x" * 300})
        assert small.status_code == 422  # parsed and judged by the schema
        telemetry = client.post(f"{live_server.url}/v1/telemetry", content=b"{" * (256 * 1024),
                                headers={"Content-Type": "application/json"})
        assert telemetry.status_code == 401  # past the body gate, stopped by auth
