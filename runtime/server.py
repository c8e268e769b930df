"""OpenAI-compatible HTTP inference on the early-exit engine.

One engine thread owns the model and runs continuous batching: requests join and leave between
steps, tokens flow back to the asyncio side through per-request queues. The threshold client
and the telemetry shipper run in their own background threads; the decode loop never waits on
the network.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger("exitplane.serve")


# -- request shapes (the subset of OpenAI's API that clients use) -------------------------------

class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=4096)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    stream: bool = False
    seed: int | None = None
    ignore_eos: bool = Field(default=False, description="extension: generate max_tokens tokens")

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if len(stops) > 4 or any(not s for s in stops):
            raise HTTPException(422, "stop takes at most 4 non-empty strings")
        return stops


class CompletionRequest(_Base):
    prompt: str | list[str]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatRequest(_Base):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]


# -- the engine thread ------------------------------------------------------------------------

@dataclass
class _Job:
    request_id: str
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    exit_layers: list[int] = field(default_factory=list)


class EngineWorker:
    """Owns the engine: admits and cancels requests between steps, runs steps while there is
    work, and hands every token to its request's asyncio queue."""

    def __init__(self, engine, *, max_queue: int, metrics: ServeMetrics) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: dict[str, _Job] = {}
        self._pending = 0  # accepted, not finished (read on the event loop)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="exitplane-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout)

    @property
    def in_flight(self) -> int:
        return self._pending

    def submit(self, prompt: list[int], *, max_tokens: int, stop_ids: list[int],
               sampling: dict) -> _Job:
        """Queue a request; raises OverflowError when the bounded queue is full."""
        with self._lock:
            if self._pending >= self.engine.config.max_batch + self.max_queue:
                raise OverflowError
            self._pending += 1
        job = _Job(f"cmpl-{uuid.uuid4().hex[:24]}", asyncio.get_running_loop(), asyncio.Queue())
        self._commands.put(("add", job, prompt, max_tokens, stop_ids, sampling))
        return job

    def cancel(self, job: _Job) -> None:
        self._commands.put(("cancel", job.request_id))

    def _done(self, job: _Job, error: str | None = None) -> None:
        with self._lock:
            self._pending -= 1
        self._jobs.pop(job.request_id, None)
        job.loop.call_soon_threadsafe(job.out.put_nowait, ("error", error) if error else None)

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, job, prompt, max_tokens, stop_ids, sampling = command
            try:
                self.engine.add_request(prompt, request_id=job.request_id,
                                        max_new_tokens=max_tokens, stop_token_ids=stop_ids,
                                        **sampling)
            except ValueError as error:
                self._done(job, str(error))
                return
            self._jobs[job.request_id] = job
        elif kind == "cancel":
            job = self._jobs.get(command[1])
            if job is not None and self.engine.cancel(job.request_id):
                self.metrics.cancelled.inc()
                self._done(job)

    def _run(self) -> None:
        while not self._stop.is_set():
            block = not self.engine.has_work
            try:
                while True:
                    self._handle(self._commands.get(block=block, timeout=0.5 if block else None))
                    block = False
            except queue.Empty:
                pass
            if not self.engine.has_work:
                continue
            started = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as error:  # a broken step fails its requests, not the server
                log.exception("engine step failed")
                for job in list(self._jobs.values()):
                    self.engine.cancel(job.request_id)
                    self._done(job, f"engine error: {type(error).__name__}")
                continue
            self.metrics.observe_step(outputs, time.perf_counter() - started)
            for output in outputs:
                job = self._jobs.get(output.request_id)
                if job is None:
                    continue
                job.loop.call_soon_threadsafe(job.out.put_nowait, output)
                if output.finished:
                    self._done(job)


# -- metrics ----------------------------------------------------------------------------------

class ServeMetrics:
    def __init__(self, num_layers: int) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.tokens = Counter("exitplane_runtime_tokens", "Generated tokens", registry=r)
        self.requests = Counter("exitplane_runtime_requests", "Requests by outcome", ["outcome"],
                                registry=r)
        self.cancelled = Counter("exitplane_runtime_cancelled", "Requests cancelled",
                                 registry=r)
        self.batch_size = Histogram("exitplane_runtime_batch_size", "Rows per decode step",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.step_seconds = Histogram("exitplane_runtime_step_seconds", "Decode step time",
                                      registry=r)
        self.exits = Counter("exitplane_runtime_exits", "Tokens by exit layer", ["layer"],
                             registry=r)
        self.queue_depth = Gauge("exitplane_runtime_queue_depth", "Requests waiting or running",
                                 registry=r)
        self.applied_version = Gauge("exitplane_runtime_applied_version",
                                     "Threshold version applied", registry=r)
        self.spooled = Gauge("exitplane_runtime_spooled_batches", "Telemetry batches on disk",
                             registry=r)
        self.dropped = Gauge("exitplane_runtime_dropped_records", "Telemetry records dropped",
                             registry=r)
        self.num_layers = num_layers

    def observe_step(self, outputs: list, seconds: float) -> None:
        if not outputs:
            return
        self.batch_size.observe(len(outputs))
        self.step_seconds.observe(seconds)
        self.tokens.inc(len(outputs))
        for output in outputs:
            self.exits.labels(str(output.record.exit_layer)).inc()


# -- text ----------------------------------------------------------------------------------

class _Detokenizer:
    """Incremental decoding that never emits half a UTF-8 character, and applies stops."""

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.ids: list[int] = []
        self.emitted = 0
        self.text = ""
        self.stopped = False

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for stop in self.stops:
            at = text.find(stop)
            if at != -1:
                text = text[:at]
                self.stopped = True
        if text.endswith("\ufffd") and not self.stopped:
            return ""
        # Hold back a tail that could still become a stop string.
        hold = 0 if self.stopped else max(
            (n for stop in self.stops for n in range(len(stop) - 1, 0, -1)
             if text.endswith(stop[:n])), default=0)
        delta = text[self.emitted:len(text) - hold]
        self.emitted += len(delta)
        self.text = text
        return delta

    def finish(self) -> str:
        delta = self.text[self.emitted:]
        self.emitted = len(self.text)
        return delta


# -- the app ----------------------------------------------------------------------------------

@dataclass
class ServeState:
    engine: Any
    tokenizer: Any
    model_name: str
    worker: EngineWorker
    metrics: ServeMetrics
    thresholds: Any = None  # ThresholdClient, or None when a static set is applied
    shipper: Any = None
    default_max_tokens: int = 256
    shutdown_grace_s: float = 10.0
    accepting: bool = True

    @property
    def ready(self) -> bool:
        client = self.thresholds
        # Ready once a set from the control plane or its cache is applied; the built-in
        # never-exit fallback serves, but is reported not ready.
        return self.accepting and (client is None or (client.ready and not client.degraded))


def create_serve_app(state: ServeState) -> FastAPI:
    """The inference server around a started EngineWorker."""

    async def lifespan(app: FastAPI):
        yield
        await _shutdown(state)

    app = FastAPI(title="exitplane runtime", lifespan=lifespan)
    app.state.serve = state

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return JSONResponse(status_code=422, content={"error": {
            "message": f"{where}: {first.get('msg')}", "type": "invalid_request_error"}})

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, error: HTTPException) -> JSONResponse:
        return JSONResponse(status_code=error.status_code, headers=error.headers,
                            content={"error": {"message": error.detail,
                                               "type": "invalid_request_error"
                                               if error.status_code < 500 else "server_error"}})

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        client = state.thresholds
        body = {"ready": state.ready, "accepting": state.accepting,
                "threshold_version": state.engine.policy.version,
                "degraded": bool(client is not None and client.degraded)}
        return JSONResponse(body, status_code=200 if state.ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        _refresh_gauges(state)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model",
                                            "owned_by": "exitplane", "created": 0}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompt = body.prompt if isinstance(body.prompt, str) else "".join(body.prompt)
        if not prompt:
            raise HTTPException(422, "prompt must not be empty")
        ids = state.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return await _serve(state, request, body, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        messages = [m.model_dump() for m in body.messages]
        ids = state.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=True)
        if not isinstance(ids, list):  # newer tokenizers return a BatchEncoding
            ids = ids["input_ids"]
        return await _serve(state, request, body, list(ids), chat=True)

    return app


def _refresh_gauges(state: ServeState) -> None:
    m = state.metrics
    m.queue_depth.set(state.worker.in_flight)
    m.applied_version.set(state.engine.policy.version)
    if state.shipper is not None:
        m.spooled.set(state.shipper.spooled_batches)
        m.dropped.set(state.shipper.dropped_records)


async def _serve(state: ServeState, request: Request, body: _Base, prompt: list[int],
                 *, chat: bool):
    if not state.accepting:
        raise HTTPException(503, "the server is shutting down", headers={"Retry-After": "5"})
    if not prompt:
        raise HTTPException(422, "the prompt encodes to no tokens")
    stops = body.stops()
    max_tokens = body.max_tokens or state.default_max_tokens
    sampling = {} if body.temperature == 0 else {
        "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed}
    try:
        job = state.worker.submit(prompt, max_tokens=max_tokens,
                                  stop_ids=[] if body.ignore_eos
                                  else list(state.engine.parts.eos_token_ids),
                                  sampling=sampling)
    except OverflowError:
        state.metrics.requests.labels("rejected").inc()
        raise HTTPException(429, "the server is at capacity; retry shortly",
                            headers={"Retry-After": "1"}) from None
    detok = _Detokenizer(state.tokenizer, stops)
    created = int(time.time())
    if body.stream:
        return StreamingResponse(_stream(state, request, job, detok, body, prompt, created,
                                         chat, max_tokens),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    tokens = 0
    finish = "length"
    async for kind, value in _tokens(state, request, job, detok):
        if kind == "token":
            tokens += 1
        elif kind == "finish":
            finish = value
    if await request.is_disconnected():
        return Response(status_code=499)
    text = detok.text
    choice = ({"index": 0, "message": {"role": "assistant", "content": text},
               "finish_reason": finish} if chat else
              {"index": 0, "text": text, "finish_reason": finish, "logprobs": None})
    state.metrics.requests.labels("ok").inc()
    return {"id": job.request_id, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": state.model_name, "choices": [choice],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": tokens,
                      "total_tokens": len(prompt) + tokens},
            "exitplane": _extension(state, job)}


def _extension(state: ServeState, job: _Job) -> dict:
    layers = job.exit_layers
    return {"mean_exit_layer": sum(layers) / len(layers) if layers else None,
            "num_layers": state.engine.parts.num_layers,
            "threshold_version": state.engine.policy.version,
            "exit_layers": layers}


async def _tokens(state: ServeState, request: Request, job: _Job,
                  detok: _Detokenizer) -> AsyncIterator[tuple[str, Any]]:
    """Yield ("token", text delta) per token, then ("finish", reason); cancels on disconnect."""
    try:
        while True:
            try:
                item = await asyncio.wait_for(job.out.get(), timeout=1.0)
            except TimeoutError:
                if await request.is_disconnected():
                    state.worker.cancel(job)
                    return
                continue
            if item is None:
                yield "finish", "stop" if detok.stopped else "length"
                return
            if isinstance(item, tuple):
                raise HTTPException(422, item[1])
            job.exit_layers.append(item.record.exit_layer)
            delta = detok.push(item.token)
            is_eos = item.token in state.engine.parts.eos_token_ids and item.finished
            yield "token", delta
            if detok.stopped or (item.finished and is_eos):
                if not item.finished:
                    state.worker.cancel(job)
                yield "finish", "stop"
                return
            if item.finished:
                yield "finish", "length"
                return
    except asyncio.CancelledError:
        state.worker.cancel(job)
        raise


async def _stream(state, request, job, detok, body, prompt, created, chat, max_tokens):
    kind_name = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None, *, first: bool = False) -> str:
        if chat:
            delta = {"role": "assistant", "content": text or ""} if first else (
                {"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        payload = {"id": job.request_id, "object": kind_name, "created": created,
                   "model": state.model_name, "choices": [choice]}
        return f"data: {json.dumps(payload)}\n\n"

    tokens = 0
    if chat:
        yield chunk("", None, first=True)
    try:
        async for kind, value in _tokens(state, request, job, detok):
            if kind == "token":
                tokens += 1
                yield chunk(value, None)
            else:
                tail = detok.finish()
                if tail:
                    yield chunk(tail, None)
                final = json.loads(chunk(None, value)[6:])
                final["usage"] = {"prompt_tokens": len(prompt), "completion_tokens": tokens,
                                  "total_tokens": len(prompt) + tokens}
                final["exitplane"] = _extension(state, job)
                yield f"data: {json.dumps(final)}\n\n"
        state.metrics.requests.labels("ok").inc()
        yield "data: [DONE]\n\n"
    except HTTPException as error:
        yield f"data: {json.dumps({'error': {'message': error.detail}})}\n\n"


async def _shutdown(state: ServeState) -> None:
    """Stop accepting, let in-flight requests finish within the grace period, cancel the rest,
    then flush telemetry to the control plane or the spool."""
    state.accepting = False
    deadline = time.monotonic() + state.shutdown_grace_s
    while state.worker.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for job in list(state.worker._jobs.values()):
        state.worker.cancel(job)
    await asyncio.to_thread(state.worker.stop)
    if state.thresholds is not None:
        await asyncio.to_thread(state.thresholds.stop)
    if state.shipper is not None:
        await asyncio.to_thread(state.shipper.close, 30.0)


# -- wiring and the command ----------------------------------------------------------------

def build_state(*, engine, tokenizer, model_name: str, control_plane: str | None,
                deployment: str | None, token: str | None, state_dir, max_queue: int = 64,
                static_thresholds=None, default_max_tokens: int = 256,
                shutdown_grace_s: float = 10.0, long_poll_s: float = 30.0,
                raw_sample_rate: float = 1.0) -> ServeState:
    """Start the engine thread, and the threshold client and shipper when a control plane is
    given; with a static set instead, apply it and serve offline."""
    from pathlib import Path

    metrics = ServeMetrics(engine.parts.num_layers)
    thresholds = shipper = None
    if control_plane:
        from exitplane.client.shipper import TelemetryShipper
        from exitplane.client.thresholds import ThresholdClient

        if not (deployment and token):
            raise ValueError("a control plane needs --deployment and --token-file")
        state_dir = Path(state_dir)
        shipper = TelemetryShipper(base_url=control_plane, token=token, deployment=deployment,
                                   runtime_id=engine.runtime_id,
                                   num_layers=engine.parts.num_layers,
                                   spool_dir=state_dir / "spool",
                                   exit_layers=engine.exit_layers,
                                   raw_sample_rate=raw_sample_rate).start()
        engine.on_record = shipper.submit
        thresholds = ThresholdClient(engine, base_url=control_plane, deployment=deployment,
                                     token=token, runtime_id=engine.runtime_id,
                                     cache_path=state_dir / "thresholds.json",
                                     long_poll_s=long_poll_s, telemetry=shipper).start()
    elif static_thresholds is not None:
        engine.set_thresholds(static_thresholds)
    worker = EngineWorker(engine, max_queue=max_queue, metrics=metrics)
    worker.start()
    return ServeState(engine=engine, tokenizer=tokenizer, model_name=model_name, worker=worker,
                      metrics=metrics, thresholds=thresholds, shipper=shipper,
                      default_max_tokens=default_max_tokens, shutdown_grace_s=shutdown_grace_s)
