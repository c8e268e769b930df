"""Liveness promises of the Celery worker and beat, for liveness probes (`EXITPLANE_HEARTBEAT_FILE`;
exitplane/kit/liveness.py says what a promise means).

- Worker: the consumer's timer renews the promise every few seconds. With Redis the timer runs
  on the worker's event loop, so a loop that hangs stops renewing it. A task running on the
  solo pool holds that loop: as it starts, the worker promises the task's time limit (which the
  solo pool does not enforce itself, so the probe does).
- Beat: every tick of the scheduler renews it; the scheduler ticks at least every
  `BEAT_MAX_INTERVAL_S`, whatever the schedule.
"""

from __future__ import annotations

import os
from pathlib import Path

from celery import Celery, bootsteps, signals
from celery.beat import PersistentScheduler

from exitplane.kit.liveness import promise

WORKER_RENEW_S = 10.0
IDLE_PROMISE_S = 60.0  # an idle worker's loop comes round every couple of seconds
STARTUP_PROMISE_S = 180.0  # importing the drift tests, reaching the broker
TASK_MARGIN_S = 60.0
BEAT_MAX_INTERVAL_S = 30.0
BEAT_PROMISE_S = 120.0  # a tick may wait on the broker while it sends a due task

_main_pid: int | None = None  # the worker's main process; prefork children promise nothing


def _heartbeat_file() -> Path | None:
    from controlplane.settings import get_settings

    return get_settings().heartbeat_file


def _promise(seconds: float) -> None:
    path = _heartbeat_file()
    if path is not None:
        promise(path, seconds)


class WorkerHeartbeat(bootsteps.StartStopStep):
    """Renews the worker's promise from the consumer's timer while the consumer runs."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, parent, **kwargs) -> None:
        super().__init__(parent, **kwargs)
        self.renewal = None

    def start(self, parent) -> None:
        if _heartbeat_file() is None:
            return
        _promise(IDLE_PROMISE_S)
        self.renewal = parent.timer.call_repeatedly(WORKER_RENEW_S, _promise, (IDLE_PROMISE_S,))

    def stop(self, parent) -> None:
        if self.renewal is not None:
            self.renewal.cancel()
            self.renewal = None


class HeartbeatScheduler(PersistentScheduler):
    """Celery's persistent scheduler, renewing beat's promise on every tick."""

    max_interval = BEAT_MAX_INTERVAL_S

    def tick(self, *args, **kwargs) -> float:
        delay = super().tick(*args, **kwargs)
        _promise(BEAT_PROMISE_S)
        return delay


@signals.worker_init.connect
def _worker_starting(**_kwargs) -> None:
    global _main_pid
    _main_pid = os.getpid()
    _promise(STARTUP_PROMISE_S)


@signals.beat_init.connect
def _beat_starting(**_kwargs) -> None:
    _promise(STARTUP_PROMISE_S)


@signals.task_prerun.connect
def _task_started(task=None, **_kwargs) -> None:
    if os.getpid() != _main_pid or task is None:
        return
    limit = task.time_limit or task.app.conf.task_time_limit or 3600
    _promise(limit + TASK_MARGIN_S)


@signals.task_postrun.connect
def _task_finished(**_kwargs) -> None:
    if os.getpid() == _main_pid:
        _promise(IDLE_PROMISE_S)


def install(app: Celery) -> None:
    """Give `app`'s worker and beat their liveness promises."""
    app.steps["consumer"].add(WorkerHeartbeat)
    app.conf.beat_scheduler = f"{__name__}:HeartbeatScheduler"
