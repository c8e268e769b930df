"""The engine thread of the runtime server: one thread owns the engine and runs continuous
batching; requests join and leave between steps and tokens flow back to the asyncio side
through per-request queues, so the event loop never waits on a decode step."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from exitplane.wire import DEFAULT_SEGMENT
from runtime.engine import StepFailed

if TYPE_CHECKING:
    from runtime.server_metrics import ServeMetrics

log = logging.getLogger("exitplane.serve")


@dataclass
class Job:
    """One request as the engine thread sees it: its id, and the queue on its event loop."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    exit_layers: list[int] = field(default_factory=list)
    segment: str = DEFAULT_SEGMENT  # whose thresholds its tokens apply
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
        self._jobs: dict[str, Job] = {}
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
               sampling: dict, segment: str = DEFAULT_SEGMENT) -> Job:
        """Queue a request; raises OverflowError when the bounded queue is full and
        EngineStopped when the engine thread is gone."""
        job = Job(f"cmpl-{uuid.uuid4().hex[:24]}", asyncio.get_running_loop(), asyncio.Queue(),
                  segment=segment)
        with self._lock:  # the same lock the dying thread takes: no job slips past its sweep
            if not self.alive:
                raise EngineStopped(self.failure or "the engine is not running")
            if self._pending >= self.engine.config.max_batch + self.max_queue:
                raise OverflowError
            self._pending += 1
            self._commands.put(("add", job, prompt, max_tokens, stop_ids, sampling))
        return job

    def cancel(self, job: Job) -> None:
        self._commands.put(("cancel", job.request_id))

    def cancel_all(self) -> None:
        """Cancel every admitted request (shutdown, after the grace period)."""
        for job in list(self._jobs.values()):
            self.cancel(job)

    def _done(self, job: Job, error: JobError | None = None) -> None:
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
                                        segment=job.segment, **sampling)
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
