"""Answering one completion or chat request: bounds checked before a stream starts, the prompt
tokenized off the event loop, tokens from the engine thread detokenized into a JSON answer or
a server-sent-event stream, and a client that goes away cancels its request."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import HTTPException, Request
from fastapi.responses import Response, StreamingResponse

from exitplane.kit import tracing
from exitplane.wire import DEFAULT_SEGMENT
from runtime.engine import StepOutput
from runtime.serving.detokenize import Detokenizer
from runtime.serving.schemas import ChatRequest, CompletionRequest, GenerationRequest
from runtime.serving.segments import SEGMENT_HEADER, MalformedSegment
from runtime.serving.state import ServeState
from runtime.serving.worker import ENGINE_DEAD, ENGINE_FAILED, EngineStopped, Job, JobError

log = logging.getLogger("exitplane.serve")
MAX_SPAN_EXIT_LAYERS = 1024


def error_body(message: str, status: int) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "code": status,
                      "type": "invalid_request_error" if status < 500 else "server_error"}}


def check_prompt_chars(state: ServeState, body: CompletionRequest | ChatRequest) -> None:
    """413 for a prompt too long to ever fit, before it is tokenized."""
    chars = body.prompt_chars()
    if chars > state.max_prompt_chars:
        raise HTTPException(413, f"the prompt is {chars} characters; this server takes at most "
                                 f"{state.max_prompt_chars} (exitplane runtime serve "
                                 "--max-prompt-chars)")


async def off_loop(pool: ThreadPoolExecutor, function, *args):
    """Run function(*args) in pool, so the event loop keeps serving other requests."""
    return await asyncio.get_running_loop().run_in_executor(pool, function, *args)


def encode(tokenizer, prompt: str) -> list[int]:
    """A completion prompt's ids, as written (no BOS added)."""
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Chat messages rendered by the tokenizer's chat template, ready for the answer."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # newer tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def segment_of(state: ServeState, request: Request, body: GenerationRequest) -> str:
    """The request's traffic segment (serving/segments.py); 400 for a malformed name."""
    try:
        return state.segments.resolve(header=request.headers.get(SEGMENT_HEADER),
                                      body=body.exitplane_segment,
                                      authorization=request.headers.get("authorization"),
                                      model=body.model)
    except MalformedSegment as error:
        raise HTTPException(400, str(error)) from None


async def respond(state: ServeState, request: Request, body: GenerationRequest,
                  prompt: list[int], *, chat: bool, segment: str = DEFAULT_SEGMENT):
    """Submit the tokenized prompt to the engine thread and answer: a JSON body, or an SSE
    stream when body.stream; 429 when the queue is full, 503 when the engine is gone."""
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
                                  sampling=sampling, segment=segment)
    except OverflowError:
        state.metrics.requests.labels("rejected").inc()
        raise HTTPException(429, "the server is at capacity; retry shortly",
                            headers={"Retry-After": "1"}) from None
    except EngineStopped:
        raise HTTPException(ENGINE_DEAD.status, ENGINE_DEAD.message) from None
    job.timer = state.metrics.request.timer(len(prompt))
    detok = Detokenizer(state.tokenizer, stops)
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
    detok.finish()  # ids held for an incomplete character at the very end
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


def _extension(state: ServeState, job: Job) -> dict:
    layers = job.exit_layers
    return {"mean_exit_layer": sum(layers) / len(layers) if layers else None,
            "num_layers": state.engine.parts.num_layers,
            "threshold_version": state.engine.policy.version,
            "segment": job.segment, "exit_layers": layers}


async def _tokens(state: ServeState, request: Request, job: Job,
                  detok: Detokenizer) -> AsyncIterator[tuple[str, Any]]:
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
            deltas = await off_loop(state.text_pool, detok.push_many,
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
        if tracing.enabled():
            _annotate_span(state, job)


def _annotate_span(state: ServeState, job: Job) -> None:
    """The request's server span: time to first token, exit layers, threshold version."""
    layers = job.exit_layers
    tracing.annotate(
        time_to_first_token_ms=None if job.timer.first is None
        else round((job.timer.first - job.timer.arrived) * 1000, 3),
        threshold_version=state.engine.policy.version, segment=job.segment,
        completion_tokens=len(layers),
        mean_exit_layer=sum(layers) / len(layers) if layers else None,
        # the exit layer of each generated token, bounded so that a long answer stays a
        # span an exporter takes
        exit_layers=layers[:MAX_SPAN_EXIT_LAYERS])


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
        yield f"data: {json.dumps(error_body(error.detail, error.status_code))}\n\n"
    except Exception:  # headers are sent: end the stream with an error event, never hang
        log.exception("stream %s failed", job.request_id)
        state.worker.cancel(job)
        yield (f"data: {json.dumps(error_body(ENGINE_FAILED.message, 500))}\n\n")
