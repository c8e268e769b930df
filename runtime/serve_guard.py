"""The runtime server's front door: API keys, a request body limit and a JSON nesting limit
(`exitplane.kit.json_depth`), checked before routing and before any JSON is parsed (an ASGI
middleware in front of the FastAPI app).

Keys come from `--api-key-file` (one per line) and/or `EXITPLANE_RUNTIME_API_KEYS`
(comma-separated). When any key is set, every route except the probes and metrics
(`/healthz`, `/readyz`, `/metrics`: orchestrators and Prometheus scrape them without a key)
needs `Authorization: Bearer <key>`, the header the OpenAI clients send.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Iterable
from pathlib import Path

from exitplane.kit.bearer import bearer_token
from exitplane.kit.json_depth import TooDeep, check_json_depth

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
API_KEYS_ENV = "EXITPLANE_RUNTIME_API_KEYS"
MIN_KEY_CHARS = 16
DEFAULT_MAX_BODY_BYTES = 1 << 20


def load_api_keys(path: str | Path | None = None, env: str | None = None) -> tuple[str, ...]:
    """Keys from a file (one a line, `#` comments) and the env variable; ValueError says what
    is wrong (an empty file, a short key)."""
    keys: list[str] = []
    if path is not None:
        lines = Path(path).read_text().splitlines()
        from_file = [line.strip() for line in lines if line.strip()
                     and not line.strip().startswith("#")]
        if not from_file:
            raise ValueError(f"--api-key-file {path} holds no API key (one key per line)")
        keys += from_file
    if env is None:
        env = os.environ.get(API_KEYS_ENV, "")
    keys += [key.strip() for key in env.split(",") if key.strip()]
    short = [key for key in keys if len(key) < MIN_KEY_CHARS]
    if short:
        raise ValueError(f"an API key must be at least {MIN_KEY_CHARS} characters; generate "
                         "one with: python3 -c 'import secrets; print(secrets.token_urlsafe(32))'")
    return tuple(dict.fromkeys(keys))


def _digest(key: bytes) -> bytes:
    # Fixed-length digests, so comparing never leaks a key's length through timing.
    return hashlib.sha256(key).digest()


def _error(status: int, message: str, code: str) -> tuple[int, bytes]:
    return status, json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                         "param": None, "code": code}}).encode()


class RequestGuard:
    """ASGI middleware: 401 without a valid key, 413 over the body limit, both before the
    app reads the request."""

    def __init__(self, app, *, api_keys: Iterable[str] = (),
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self._digests = [_digest(key.encode()) for key in api_keys]
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self._digests and scope["path"] not in OPEN_PATHS and not self._authorized(headers):
            await _respond(send, *_error(
                401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                "invalid_api_key"), extra=[(b"www-authenticate", b"Bearer")])
            return
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = headers.get(b"content-length")
        too_large = _error(413, f"the request body is over {self.max_body_bytes} bytes, the "
                                "most this server accepts (exitplane runtime serve "
                                "--max-body-bytes)", "request_too_large")
        if declared is not None and (not declared.isdigit()
                                     or int(declared) > self.max_body_bytes):
            await _respond(send, *too_large, extra=[(b"connection", b"close")])
            return
        # Chunked bodies carry no length: read up to the limit, then hand the app a replay.
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                await _respond(send, *too_large, extra=[(b"connection", b"close")])
                return
            if not message.get("more_body", False):
                break
        try:
            check_json_depth(b"".join(m.get("body", b"") for m in messages
                                      if m["type"] == "http.request"))
        except TooDeep as error:
            await _respond(send, *_error(422, f"the request body {error}",
                                         "invalid_request_error"), extra=[])
            return

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        key = bearer_token(headers.get(b"authorization", b"").decode("latin-1"))
        if key is None:
            return False
        offered = _digest(key.encode("latin-1"))
        matched = False
        for digest in self._digests:  # no early exit: every key is compared every time
            matched |= hmac.compare_digest(offered, digest)
        return matched


async def _respond(send, status: int, body: bytes, *, extra: list) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *extra]})
    await send({"type": "http.response.body", "body": body})
