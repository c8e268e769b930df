"""Loopback ports and servers in threads: a free port, a `socketserver` server, the app under a
real uvicorn, and a spy on which requests reach an app's router."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_in_thread(server) -> threading.Thread:
    """Run a `socketserver` server's `serve_forever` in a daemon thread. It checks for
    `shutdown()` every 20 ms: at the default 0.5 s every test that stops a receiver waited
    half a second in its teardown."""
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02},
                              daemon=True)
    thread.start()
    return thread


@dataclass
class LiveServer:
    url: str
    server: object
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def start_server(app) -> LiveServer:
    """`app` on a real uvicorn on a loopback port, in a thread; `stop()` ends it."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off",
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    return LiveServer(url=f"http://127.0.0.1:{port}", server=server, thread=thread)


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """`app` on a real uvicorn in a thread; yields its URL."""
    live = start_server(app)
    try:
        yield live.url
    finally:
        live.stop()


class RouterSpy:
    """Stands in for an app's router and records which paths reach it (a fast path's answers
    never do); passes everything on."""

    def __init__(self, router) -> None:
        self.router = router
        self.paths: list[str] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            self.paths.append(scope["path"])
        await self.router(scope, receive, send)

    def __getattr__(self, name):
        return getattr(self.router, name)


def raw_response(connection: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of the answer on `connection`; socket.timeout if none comes."""
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = connection.recv(65536)
        assert chunk, "the server closed the connection without an answer"
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    headers = {line.split(b":", 1)[0].decode().lower(): line.split(b":", 1)[1].strip().decode()
               for line in head.split(b"\r\n")[1:]}
    while len(body) < int(headers["content-length"]):
        body += connection.recv(65536)
    return int(head.split()[1]), headers, body
