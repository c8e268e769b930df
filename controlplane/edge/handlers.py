"""How errors are answered: domain errors with their status (401 with WWW-Authenticate, 429
with Retry-After), validation errors as one message and a list, the store or Redis away as
503 with Retry-After, a value the store cannot hold as 422."""

from __future__ import annotations

import logging

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from controlplane.db import out_of_range_errors, store_away, store_errors
from controlplane.edge.body import is_json_media, takes_json_body
from controlplane.errors import DomainError
from controlplane.guards.holds import hold_refusal
from controlplane.health import store_unavailable_detail

log = logging.getLogger("exitplane.api")


def install_exception_handlers(app: FastAPI) -> None:
    """Register the API's exception handlers on `app` (call it once the engine exists, so the
    store's driver and its error classes are loaded)."""
    app.add_exception_handler(DomainError, domain_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    for kind in store_errors():  # the most specific handler applies: DataError's is 422
        app.add_exception_handler(kind, store_error)
    for kind in out_of_range_errors():
        app.add_exception_handler(kind, out_of_range)
    app.add_exception_handler(redis.RedisError, queue_unavailable)


def handler_for(handlers: dict, error: Exception):
    """The app's handler for `error`'s class or its nearest base, as Starlette looks it up."""
    for cls in type(error).__mro__:
        if cls in handlers:
            return handlers[cls]
    return None


async def domain_error(request: Request, error: DomainError) -> JSONResponse:
    await hold_refusal(request, error)  # a cap reached; rate refusals were held already
    headers = {}
    if error.status_code == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if hasattr(error, "retry_after"):
        headers["Retry-After"] = str(max(1, round(error.retry_after)))
    # Answered: its frames (a request's body among them) would otherwise wait for a full
    # garbage collection, held in reference cycles through the thread hand-off.
    error.__traceback__ = None
    return JSONResponse(status_code=error.status_code,
                        content={"detail": str(error), **error.extra}, headers=headers)


async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    media = request.headers.get("content-type", "")
    if takes_json_body(request.scope.get("route")) and not is_json_media(media):
        # FastAPI reads such a body as bytes and fails on its type: say what is wrong.
        return JSONResponse(status_code=415, content={"detail": (
            f"this route takes a JSON body: send Content-Type: application/json, not "
            f"{media[:100] or 'none'}")})
    first = error.errors()[0] if error.errors() else {}
    where = ".".join(str(part) for part in first.get("loc", ()))
    message = f"{where}: {first.get('msg', 'invalid input')}" if where else "invalid input"
    return JSONResponse(status_code=422, content={
        "detail": message, "errors": _jsonable(error.errors())})


async def out_of_range(_request: Request, error: Exception) -> JSONResponse:
    # A value the schema allows but the store cannot hold (a number past 64 bits, a sum
    # past a counter's end, text too long for its column).
    return JSONResponse(status_code=422, content={
        "detail": "a value in the request cannot be stored: out of range or too long"})


async def store_error(_request: Request, error: Exception) -> JSONResponse:
    # The store away or busy (whichever layer raised it: a COPY runs on the driver's own
    # connection) is 503, so runtimes retry and keep their order; anything else about
    # the store is a fault of ours, 500.
    if store_away(error):
        log.warning("store unavailable: %s", type(error).__name__)
        return JSONResponse(status_code=503, headers={"Retry-After": "2"},
                            content={"detail": store_unavailable_detail(error)})
    log.error("store error", exc_info=error)
    return JSONResponse(status_code=500, content={"detail": "internal error"})


async def queue_unavailable(_request: Request, error: Exception) -> JSONResponse:
    # Redis refusing or away (a restart, a failover's READONLY, maxmemory): the queue is
    # unavailable, never the batch's fault.
    log.warning("telemetry queue unavailable: %s", type(error).__name__)
    return JSONResponse(status_code=503, headers={"Retry-After": "2"},
                        content={"detail": "the telemetry queue is unavailable; "
                                           "retry shortly"})


def _jsonable(errors: list[dict]) -> list[dict]:
    """Pydantic's errors as JSON: `loc` a list of keys and indexes, `msg`, `type` (the
    offending `input` is not echoed back)."""
    return [{"loc": [part if isinstance(part, int) else str(part) for part in err.get("loc", ())],
             "msg": str(err.get("msg", "")), "type": str(err.get("type", ""))}
            for err in errors]
