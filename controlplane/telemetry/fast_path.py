"""Pure-ASGI answer for `POST /v1/telemetry`, the request a fleet sends most (issue 14).

At fleet scale the API's cost is per request, and most of it was FastAPI's routing, dependency
solving and response serialisation around a body that `store_batch` checks and queues anyway.
This layer sits inside the body-size gate (so 413 and the body read are unchanged) and inside
the request-id/metrics middleware, and does what the route's dependencies do, in the same
order and with the same functions: the bearer token (`resolve_principal`, the same cache), the
token's ingest rate limit (the same shared bucket), the runtime scope, then `store_batch`, all
on one worker thread. An error is answered by the app's own exception handler for it, so
status codes, messages and headers (WWW-Authenticate, Retry-After) are the route's. The route
stays registered: it describes the operation in the OpenAPI document and serves when the fast
path is turned off (`EXITPLANE_TELEMETRY_FAST_PATH=false`).
"""

from __future__ import annotations

from anyio import to_thread
from starlette.requests import Request

from controlplane.deps import check_rate_blocking, resolve_principal
from controlplane.telemetry.api import router, store_batch
from controlplane.telemetry.schemas import IngestAck

TELEMETRY_PATH = "/v1/telemetry"


class TelemetryFastPath:
    """Serve `POST /v1/telemetry` without entering the router; everything else passes on."""

    def __init__(self, app) -> None:
        self.app = app
        # The route's APIRoute: request metrics, logs and traces name the route as before.
        [self._route] = [route for route in router.routes if route.path == TELEMETRY_PATH
                         and "POST" in route.methods]

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] != "http" or scope["method"] != "POST"
                or scope["path"] != scope.get("root_path", "") + TELEMETRY_PATH):
            await self.app(scope, receive, send)
            return
        api = scope["app"]
        scope["route"] = self._route
        authorization = content_type = None
        for name, value in scope["headers"]:
            if name == b"authorization" and authorization is None:
                authorization = value.decode("latin-1")
            elif name == b"content-type" and content_type is None:
                content_type = value.decode("latin-1")
        # The body first: the size gate outside has already read and buffered all of it, so
        # nothing is spent on a refused request that the route would not have spent.
        body = await _read_body(receive)
        if body is None:
            return  # the client left before its body was complete: nobody to answer
        try:
            ack = await to_thread.run_sync(_serve, api.state, authorization or "",
                                           content_type or "application/json", body)
        except Exception as error:
            handler = _handler_for(api.exception_handlers, error)
            if handler is None:
                raise  # as in the route: the server-error middleware answers 500
            response = await handler(Request(scope, receive), error)
            await response(scope, receive, send)
            return
        payload = ack.model_dump_json().encode()
        await send({"type": "http.response.start", "status": 202,
                    "headers": [(b"content-length", str(len(payload)).encode()),
                                (b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": payload})


def _serve(state, authorization: str, content_type: str, body: bytes) -> IngestAck:
    """The route's dependencies and body, in their order, on one worker thread (one thread
    hop per request; the rate limit's Redis call through the blocking client)."""
    principal = resolve_principal(state, authorization)
    check_rate_blocking(state, "ingest", principal)
    principal.require("runtime")
    return store_batch(state, principal, body, content_type)


async def _read_body(receive) -> bytes | None:
    """The whole body (the size gate outside has already bounded and buffered it), or None
    when the client disconnected."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _handler_for(handlers: dict, error: Exception):
    """The app's handler for `error`'s class or its nearest base, as Starlette looks it up."""
    for cls in type(error).__mro__:
        if cls in handlers:
            return handlers[cls]
    return None
