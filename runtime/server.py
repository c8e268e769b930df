"""OpenAI-compatible HTTP inference on the early-exit engine.

One engine thread owns the model and runs continuous batching: requests join and leave between
steps, tokens flow back to the asyncio side through per-request queues. The threshold client
and the telemetry shipper run in their own background threads; the decode loop never waits on
the network.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
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
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from runtime.engine import StepFailed, StepOutput
from runtime.serve_guard import DEFAULT_MAX_BODY_BYTES, RequestGuard
from runtime.server_metrics import RequestMetrics

log = logging.getLogger("exitplane.serve")


# -- request shapes (the subset of OpenAI's API that clients use) -------------------------------

# Bounds the engine accepts; a value outside them is a 422 naming the field, never an error
# from deep inside torch (a seed past 2**63-1 used to surface as "Overflow when unpacking").
MAX_STOPS = 4
MAX_STOP_CHARS = 256
SEED_MAX = 2**63 - 1


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(default=None, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1, le=4096)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=1, description="one choice per request")
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    stop: str | list[str] | None = None
    stream: bool = False
    seed: int | None = Field(default=None, ge=0, le=SEED_MAX)
    ignore_eos: bool = Field(default=False, description="extension: generate max_tokens tokens")

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise ValueError(f"stop takes at most {MAX_STOPS} non-empty strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string is at most {MAX_STOP_CHARS} characters")
        return stop

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def _unsupported_logprobs(value: Any) -> Any:
    if value:
        raise ValueError("logprobs are not supported by this server")
    return value


_NoLogprobs = AfterValidator(_unsupported_logprobs)


class CompletionRequest(_Base):
    prompt: str | list[str]
    logprobs: Annotated[int | None, Field(ge=0, le=5), _NoLogprobs] = None
    best_of: int | None = Field(default=None, ge=1, le=1)

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else "".join(self.prompt)

    def prompt_chars(self) -> int:
        return len(self.prompt) if isinstance(self.prompt, str) else sum(map(len, self.prompt))


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool"]
    content: str


# what the chat template adds per message, roughly: counted so that many empty messages
# cannot slip a huge render past the character check
_MESSAGE_OVERHEAD_CHARS = 16


class ChatRequest(_Base):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(default=None, ge=1, le=4096)
    logprobs: Annotated[bool | None, _NoLogprobs] = None
    top_logprobs: Annotated[int | None, Field(ge=0, le=20), _NoLogprobs] = None

    def prompt_chars(self) -> int:
        return sum(len(m.content) + _MESSAGE_OVERHEAD_CHARS for m in self.messages)


# -- the engine thread ------------------------------------------------------------------------

@dataclass
class _Job:
    request_id: str
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    exit_layers: list[int] = field(default_factory=list)
    timer: Any = None  # server_metrics.RequestTimer: TTFT, inter-token and e2e latency


@dataclass(frozen=True)
class JobError:
    """What a request's queue gets instead of tokens when it failed: a status and a plain
    message for the client (internal details go to the log only)."""

    status: int
    message: str


class EngineStopped(RuntimeError):
    """The engine thread is gone; only a restart brings it back."""


ENGINE_FAILED = JobError(500, "the engine failed while generating this request; retry it")
ENGINE_DEAD = JobError(503, "the engine stopped; this runtime needs a restart")


class EngineWorker:
    """Owns the engine: admits and cancels requests between steps, runs steps while there is
    work, and hands every token to its request's asyncio queue.

    A step that raises fails the requests it names (or the whole batch) and the loop goes on;
    anything that escapes the loop marks the worker dead, fails every open request with 503
    and turns /healthz to 503, so that an orchestrator restarts the process."""

    def __init__(self, engine, *, max_queue: int, metrics: ServeMetrics,
                 stuck_after_s: float = 120.0) -> None:
        self.engine = engine
        self.stuck_after_s = stuck_after_s
        self._step_started: float | None = None  # monotonic, while a step runs
        self.max_queue = max_queue
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: dict[str, _Job] = {}
        self._pending = 0  # accepted, not finished (read on the event loop)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.failure: str | None = None  # why the engine thread died, for the log and probes
        self._thread = threading.Thread(target=self._run, name="exitplane-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """The engine thread runs and has not died of an error."""
        return self.failure is None and self._thread.is_alive()

    @property
    def stuck_for(self) -> float | None:
        """Seconds the current step has run, when that is past stuck_after_s (a hung device
        or a deadlock: the thread lives but serves nobody)."""
        started = self._step_started
        if started is None or time.monotonic() - started < self.stuck_after_s:
            return None
        return time.monotonic() - started

    @property
    def in_flight(self) -> int:
        return self._pending

    def submit(self, prompt: list[int], *, max_tokens: int, stop_ids: list[int],
               sampling: dict) -> _Job:
        """Queue a request; raises OverflowError when the bounded queue is full and
        EngineStopped when the engine thread is gone."""
        job = _Job(f"cmpl-{uuid.uuid4().hex[:24]}", asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:  # the same lock the dying thread takes: no job slips past its sweep
            if not self.alive:
                raise EngineStopped(self.failure or "the engine is not running")
            if self._pending >= self.engine.config.max_batch + self.max_queue:
                raise OverflowError
            self._pending += 1
            self._commands.put(("add", job, prompt, max_tokens, stop_ids, sampling))
        return job

    def cancel(self, job: _Job) -> None:
        self._commands.put(("cancel", job.request_id))

    def _done(self, job: _Job, error: JobError | None = None) -> None:
        with self._lock:
            self._pending -= 1
        self._jobs.pop(job.request_id, None)
        if error is not None:
            self.metrics.requests.labels("error").inc()
        job.loop.call_soon_threadsafe(job.out.put_nowait, error)

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, job, prompt, max_tokens, stop_ids, sampling = command
            try:
                self.engine.add_request(prompt, request_id=job.request_id,
                                        max_new_tokens=max_tokens, stop_token_ids=stop_ids,
                                        **sampling)
            except ValueError as error:  # the engine's own checks: what to change, in words
                self._done(job, JobError(422, str(error)))
                return
            except Exception:
                log.exception("engine refused request %s", job.request_id)
                self._done(job, ENGINE_FAILED)
                return
            self._jobs[job.request_id] = job
        elif kind == "cancel":
            job = self._jobs.get(command[1])
            if job is not None and self.engine.cancel(job.request_id):
                self.metrics.cancelled.inc()
                self._done(job)

    def _run(self) -> None:
        try:
            self._serve_steps()
        except BaseException as error:  # whatever killed the loop, say so and stay dead
            self._die(error)

    def _serve_steps(self) -> None:
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
            self._step_started = time.monotonic()
            try:
                outputs = self.engine.step()
            except StepFailed as failed:  # the engine dropped these rows; the rest go on
                log.error("engine step failed for %s", failed.request_ids,
                          exc_info=failed.__cause__)
                for request_id in failed.request_ids:
                    if (job := self._jobs.get(request_id)) is not None:
                        self._done(job, ENGINE_FAILED)
                continue
            except Exception:  # not attributable: fail every running request
                log.exception("engine step failed")
                for job in list(self._jobs.values()):
                    self.engine.cancel(job.request_id)
                    self._done(job, ENGINE_FAILED)
                continue
            finally:
                self._step_started = None
            self.metrics.observe_step(outputs, time.perf_counter() - started)
            for output in outputs:
                job = self._jobs.get(output.request_id)
                if job is None:
                    continue
                job.loop.call_soon_threadsafe(job.out.put_nowait, output)
                if output.finished:
                    self._done(job)

    def _die(self, error: BaseException) -> None:
        """Fail every open request with 503 and stay dead: /healthz reports it."""
        log.critical("the engine thread died; /healthz now answers 503", exc_info=error)
        with self._lock:
            self.failure = type(error).__name__
            jobs = list(self._jobs.values())
            self._jobs.clear()
            while True:  # requests queued but never admitted
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if command[0] == "add":
                    jobs.append(command[1])
            self._pending = 0
        for job in jobs:
            with contextlib.suppress(RuntimeError):  # that request's event loop is closed
                job.loop.call_soon_threadsafe(job.out.put_nowait, ENGINE_DEAD)


# -- metrics ----------------------------------------------------------------------------------

class ServeMetrics:
    def __init__(self, num_layers: int, model_name: str = "model") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.request = RequestMetrics(r, model_name)  # vLLM-style request latencies (issue 15)
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

class _StopMatcher:
    """Knuth-Morris-Pratt over the generated text, fed only the characters each token adds:
    finding a stop (and how much of the tail could still become one) costs O(new characters)
    per token, however long the text and the stop string are."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.state = 0  # length of the longest suffix of the text that is a prefix of stop
        self._fail = [0] * len(stop)  # KMP failure function
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self._fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self._fail[i] = k

    def feed(self, text: str) -> int | None:
        """Advance over text; the index in it just past the first complete match, or None."""
        stop, fail, k = self.stop, self._fail, self.state
        for i, char in enumerate(text):
            while k and char != stop[k]:
                k = fail[k - 1]
            if char == stop[k]:
                k += 1
                if k == len(stop):
                    self.state = k
                    return i + 1
        self.state = k
        return None


class _Detokenizer:
    """Incremental decoding that never emits half a UTF-8 character, and applies stops.

    Each token decodes a short window of ids (from the last emitted boundary), not the whole
    generation, so a token costs the same at position 10 and 4,000; callers run it off the
    event loop (ServeState.text_pool)."""

    MAX_PENDING = 8  # tokens held for an incomplete character before it is emitted as is

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.tokenizer = tokenizer
        self._matchers = [_StopMatcher(stop) for stop in stops]
        self.ids: list[int] = []
        self._prefix_at = 0  # window start: one token before the unread ones (word spacing)
        self._read_at = 0  # ids before this are in self.text
        self.emitted = 0
        self.text = ""
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        """The text delta this token releases ('' while a character or a stop is pending)."""
        if self.stopped:
            return ""
        self.ids.append(token)
        prefix = self._decode(self.ids[self._prefix_at:self._read_at])
        window = self._decode(self.ids[self._prefix_at:])
        new = window[len(prefix):]
        pending = len(self.ids) - self._read_at
        if (not new or new.endswith("\ufffd")) and pending < self.MAX_PENDING:
            return ""
        self._prefix_at, self._read_at = self._read_at, len(self.ids)
        start = len(self.text)
        self.text += new
        cut = None
        for matcher in self._matchers:
            end = matcher.feed(new)
            if end is not None:
                at = start + end - len(matcher.stop)
                cut = at if cut is None else min(cut, at)
        if cut is not None:
            self.text = self.text[:cut]
            self.stopped = True
        # Hold back a tail that could still become a stop string.
        hold = 0 if self.stopped else max((m.state for m in self._matchers), default=0)
        delta = self.text[self.emitted:len(self.text) - hold]
        self.emitted += len(delta)
        return delta

    def push_many(self, tokens: list[int]) -> list[str]:
        """push() each token until a stop matches; one delta per token pushed."""
        deltas = []
        for token in tokens:
            if self.stopped:
                break
            deltas.append(self.push(token))
        return deltas

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
    api_keys: tuple[str, ...] = ()  # empty: /v1 is open (loopback or an internal network)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_chars: int = 32_768  # checked before tokenizing
    # Tokenizing and detokenizing run here, never on the event loop: a huge prompt or a slow
    # decode must not stall every other stream. Prompts get their own pool so that a burst of
    # long prompts cannot queue in front of the per-token work of running streams.
    prompt_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        2, thread_name_prefix="exitplane-prompt"))
    text_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        2, thread_name_prefix="exitplane-text"))

    @property
    def ready(self) -> bool:
        client = self.thresholds
        # Ready once a set from the control plane or its cache is applied; the built-in
        # never-exit fallback serves, but is reported not ready.
        return self.accepting and (client is None or (client.ready and not client.degraded))


def _error_body(message: str, status: int) -> dict:
    return {"error": {"message": message, "code": status,
                      "type": "invalid_request_error" if status < 500 else "server_error"}}


def create_serve_app(state: ServeState) -> FastAPI:
    """The inference server around a started EngineWorker."""

    async def lifespan(app: FastAPI):
        yield
        await _shutdown(state)

    app = FastAPI(title="exitplane runtime", lifespan=lifespan)
    app.state.serve = state
    app.add_middleware(RequestGuard, api_keys=state.api_keys,
                       max_body_bytes=state.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return JSONResponse(status_code=422,
                            content=_error_body(f"{where}: {first.get('msg')}", 422))

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, error: HTTPException) -> JSONResponse:
        return JSONResponse(status_code=error.status_code, headers=error.headers,
                            content=_error_body(error.detail, error.status_code))

    @app.exception_handler(Exception)
    async def unexpected(_request: Request, _error: Exception) -> JSONResponse:
        # The traceback goes to the log (Starlette re-raises after this); the client gets
        # no internal text.
        return JSONResponse(status_code=500, content=_error_body(
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
        return JSONResponse({"status": "ok", "engine": "running"})

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
        _check_prompt_chars(state, body)
        prompt = body.prompt_text()
        if not prompt:
            raise HTTPException(422, "prompt must not be empty")
        ids = await _off_loop(state.prompt_pool, _encode, state.tokenizer, prompt)
        return await _serve(state, request, body, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        _check_prompt_chars(state, body)
        messages = [m.model_dump() for m in body.messages]
        ids = await _off_loop(state.prompt_pool, _encode_chat, state.tokenizer, messages)
        return await _serve(state, request, body, ids, chat=True)

    return app


def _check_prompt_chars(state: ServeState, body: CompletionRequest | ChatRequest) -> None:
    chars = body.prompt_chars()
    if chars > state.max_prompt_chars:
        raise HTTPException(413, f"the prompt is {chars} characters; this server takes at most "
                                 f"{state.max_prompt_chars} (exitplane runtime serve "
                                 "--max-prompt-chars)")


async def _off_loop(pool: ThreadPoolExecutor, function, *args):
    return await asyncio.get_running_loop().run_in_executor(pool, function, *args)


def _encode(tokenizer, prompt: str) -> list[int]:
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def _encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # newer tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


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
    max_tokens = (body.max_tokens or getattr(body, "max_completion_tokens", None)
                  or state.default_max_tokens)
    max_seq_len = state.engine.config.max_seq_len
    if len(prompt) + max_tokens > max_seq_len:  # a 422 before a stream starts, not inside it
        raise HTTPException(422, f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) "
                                 f"exceeds max_seq_len {max_seq_len}")
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
    except EngineStopped:
        raise HTTPException(ENGINE_DEAD.status, ENGINE_DEAD.message) from None
    job.timer = state.metrics.request.timer(len(prompt))
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
    """Yield ("token", text delta) per token, then ("finish", reason); cancels on disconnect.

    Raises HTTPException when the engine failed the request or died."""
    eos_ids = state.engine.parts.eos_token_ids
    try:
        while True:
            try:
                item = await asyncio.wait_for(job.out.get(), timeout=1.0)
            except TimeoutError:
                if not state.worker.alive:  # belt and braces: never wait on a dead engine
                    raise HTTPException(ENGINE_DEAD.status, ENGINE_DEAD.message) from None
                if await request.is_disconnected():
                    state.worker.cancel(job)
                    return
                continue
            # Tokens that arrived together are detokenized in one trip to the text pool.
            items = [item]
            while isinstance(item, StepOutput) and not job.out.empty():
                item = job.out.get_nowait()
                items.append(item)
            outputs = [i for i in items if isinstance(i, StepOutput)]
            deltas = await _off_loop(state.text_pool, detok.push_many,
                                     [o.token for o in outputs]) if outputs else []
            for output, delta in zip(outputs, deltas, strict=False):
                job.exit_layers.append(output.record.exit_layer)
                job.timer.token()
                yield "token", delta
                if detok.stopped or (output.finished and output.token in eos_ids):
                    if not output.finished:
                        state.worker.cancel(job)
                    yield "finish", "stop"
                    return
                if output.finished:
                    yield "finish", "length"
                    return
            last = items[-1]
            if isinstance(last, JobError):
                raise HTTPException(last.status, last.message)
            if last is None:
                yield "finish", "stop" if detok.stopped else "length"
                return
    except asyncio.CancelledError:
        state.worker.cancel(job)
        raise
    finally:
        job.timer.finish()


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
        yield f"data: {json.dumps(_error_body(error.detail, error.status_code))}\n\n"
    except Exception:  # headers are sent: end the stream with an error event, never hang
        log.exception("stream %s failed", job.request_id)
        state.worker.cancel(job)
        yield (f"data: {json.dumps(_error_body(ENGINE_FAILED.message, 500))}\n\n")


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
    state.prompt_pool.shutdown(wait=False, cancel_futures=True)
    state.text_pool.shutdown(wait=False, cancel_futures=True)
    if state.thresholds is not None:
        await asyncio.to_thread(state.thresholds.stop)
    if state.shipper is not None:
        await asyncio.to_thread(state.shipper.close, 30.0)


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


# -- wiring and the command ----------------------------------------------------------------

def build_state(*, engine, tokenizer, model_name: str, control_plane: str | None,
                deployment: str | None, token: str | None, state_dir, max_queue: int = 64,
                static_thresholds=None, default_max_tokens: int = 256,
                shutdown_grace_s: float = 10.0, long_poll_s: float = 30.0,
                api_keys: tuple[str, ...] = (), max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                max_prompt_chars: int | None = None,
                stuck_after_s: float = 120.0,
                raw_sample_rate: float = 1.0) -> ServeState:
    """Start the engine thread, and the threshold client and shipper when a control plane is
    given; with a static set instead, apply it and serve offline.

    max_prompt_chars defaults to 32 characters per token of the engine's max_seq_len: more
    than any real tokenizer packs, so only prompts that could never fit are refused unread.
    A step running longer than stuck_after_s turns /healthz to 503."""
    from pathlib import Path

    metrics = ServeMetrics(engine.parts.num_layers, model_name)
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
    worker = EngineWorker(engine, max_queue=max_queue, metrics=metrics,
                          stuck_after_s=stuck_after_s)
    worker.start()
    return ServeState(engine=engine, tokenizer=tokenizer, model_name=model_name, worker=worker,
                      metrics=metrics, thresholds=thresholds, shipper=shipper,
                      default_max_tokens=default_max_tokens, shutdown_grace_s=shutdown_grace_s,
                      api_keys=tuple(api_keys), max_body_bytes=max_body_bytes,
                      max_prompt_chars=max_prompt_chars or 32 * engine.config.max_seq_len)
