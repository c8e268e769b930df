"""The runtime server's FastAPI app: probes, metrics, the OpenAI-compatible routes (thin; see
respond.py), graceful shutdown, and the exit after the engine thread dies."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from exitplane import __version__
from exitplane.kit import tracing
from exitplane.kit.logs import RequestLog, access_log_enabled
from runtime.serve_guard import RequestGuard
from runtime.serving.respond import (
    check_prompt_chars,
    encode,
    encode_chat,
    error_body,
    off_loop,
    respond,
    segment_of,
)
from runtime.serving.schemas import ChatRequest, CompletionRequest
from runtime.serving.state import ServeState

log = logging.getLogger("exitplane.serve")


def create_serve_app(state: ServeState) -> FastAPI:
    """The inference server around a started EngineWorker."""

    async def lifespan(app: FastAPI):
        yield
        await _shutdown(state)

    app = FastAPI(title="exitplane runtime", version=__version__, lifespan=lifespan)
    app.state.serve = state
    app.add_middleware(RequestGuard, api_keys=state.api_keys,
                       max_body_bytes=state.max_body_bytes)
    # Outside the guard, so refused requests have their line too; on unless
    # EXITPLANE_ACCESS_LOG=0, as a serving process is a production one.
    app.add_middleware(RequestLog, access_log=access_log_enabled("production"))
    tracing.instrument_app(app)  # a server span per request, when OTEL_* configures tracing

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return JSONResponse(status_code=422,
                            content=error_body(f"{where}: {first.get('msg')}", 422))

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, error: HTTPException) -> JSONResponse:
        return JSONResponse(status_code=error.status_code, headers=error.headers,
                            content=error_body(error.detail, error.status_code))

    @app.exception_handler(Exception)
    async def unexpected(_request: Request, _error: Exception) -> JSONResponse:
        # The traceback goes to the log (Starlette re-raises after this); the client gets
        # no internal text.
        return JSONResponse(status_code=500, content=error_body(
            "internal error while serving this request; see the runtime's log", 500))

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        """Liveness: 503 once the engine thread is gone or one step has hung past
        stuck_after_s, so that an orchestrator restarts the process."""
        worker = state.worker
        if not worker.alive:
            return JSONResponse({"status": "unhealthy", "engine": "stopped",
                                 "reason": worker.failure or "stopped"}, status_code=503)
        if (stuck := worker.stuck_for) is not None:
            return JSONResponse({"status": "unhealthy", "engine": "stuck",
                                 "reason": f"one step has run {stuck:.0f} s"}, status_code=503)
        return JSONResponse({"status": "ok", "engine": "running", "version": __version__})

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        client = state.thresholds
        body = {"ready": state.ready, "accepting": state.accepting,
                "threshold_version": state.engine.policy.version,
                "degraded": bool(client is not None and client.degraded)}
        return JSONResponse(body, status_code=200 if state.ready else 503)

    state.metrics.watch(state)  # the client's, shipper's and queue's state, read per scrape

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model",
                                            "owned_by": "exitplane", "created": 0}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        segment = segment_of(state, request, body)
        check_prompt_chars(state, body)
        prompt = body.prompt_text()
        if not prompt:
            raise HTTPException(422, "prompt must not be empty")
        ids = await off_loop(state.prompt_pool, encode, state.tokenizer, prompt)
        return await respond(state, request, body, ids, chat=False, segment=segment)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        segment = segment_of(state, request, body)
        check_prompt_chars(state, body)
        messages = [m.model_dump() for m in body.messages]
        ids = await off_loop(state.prompt_pool, encode_chat, state.tokenizer, messages)
        return await respond(state, request, body, ids, chat=True, segment=segment)

    return app


async def _shutdown(state: ServeState) -> None:
    """Stop accepting, let in-flight requests finish within the grace period, cancel the rest,
    flush telemetry to the control plane or the spool, and leave the fleet."""
    state.accepting = False
    deadline = time.monotonic() + state.shutdown_grace_s
    while state.worker.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    state.worker.cancel_all()
    await asyncio.to_thread(state.worker.stop)
    state.prompt_pool.shutdown(wait=False, cancel_futures=True)
    state.text_pool.shutdown(wait=False, cancel_futures=True)
    if state.shipper is not None:
        await asyncio.to_thread(state.shipper.close, 30.0)
    if state.thresholds is not None:
        # Flushed first, then out of the fleet: a stopped runtime is no ghost, no
        # `runtime_stale` alert and no canary member.
        if (problem := await asyncio.to_thread(state.thresholds.leave)) is not None:
            log.warning("%s", problem)
        await asyncio.to_thread(state.thresholds.stop)


def exit_when_engine_dies(state: ServeState, server, *, grace_s: float) -> threading.Thread:
    """After the engine thread dies, keep answering 503 for grace_s (probes and load balancers
    see it), then stop the uvicorn server so that the process exits and a plain restart policy
    (docker compose `restart:`) brings it back; Docker alone never restarts on unhealthy."""

    def watch() -> None:
        while state.worker.failure is None:
            if not state.accepting:  # a normal shutdown
                return
            time.sleep(0.2)
        time.sleep(grace_s)
        log.critical("exiting: the engine thread died (%s)", state.worker.failure)
        server.should_exit = True

    thread = threading.Thread(target=watch, name="exitplane-engine-watch", daemon=True)
    thread.start()
    return thread
