"""The one Celery configuration, for every environment, and the app the outbox sends through.

Embedded default: an SQLAlchemy/SQLite broker and result store under `var_dir` (one real worker
process, solo pool). Production: Redis (`EXITPLANE_REDIS_URL`) as broker and result backend.
Tasks acknowledge late and are re-queued when a worker dies mid-task, so each is idempotent.

The worker and beat processes run this app through `workers.app`, which adds what only they
need (their logging and metrics signals, the alert reactions):

    celery -A workers.app worker --pool=solo      # or: exitplane worker
    celery -A workers.app beat                    # or: exitplane beat

The task modules are named, not imported: the control plane does not depend on `workers/`.
"""

from __future__ import annotations

from celery import Celery, signals
from celery.schedules import crontab

from controlplane.settings import Settings, get_settings
from exitplane.kit.logs import request_id_var

TASK_MODULES = ["workers.tasks.drift", "workers.tasks.alerts", "workers.tasks.maintenance",
                "workers.tasks.calibration", "workers.tasks.shadow_rate",
                "workers.tasks.curve"]
QUEUE = "exitplane"
# The message header that carries the request id from whoever enqueued a task into the task's
# log lines (workers/observability.py puts it back into the logging context).
REQUEST_ID_HEADER = "exitplane_request_id"


@signals.before_task_publish.connect
def _carry_request_id(headers=None, **_kwargs) -> None:
    """A task published while a request (or another task) is handled carries its id."""
    request_id = request_id_var.get()
    if request_id and headers is not None and REQUEST_ID_HEADER not in headers:
        headers[REQUEST_ID_HEADER] = request_id


def broker_urls(settings: Settings) -> tuple[str, str]:
    """(broker, result backend) for `settings`."""
    if settings.redis_url:
        return settings.redis_url, settings.redis_url
    var_dir = settings.var_dir.resolve()
    return f"sqla+sqlite:///{var_dir / 'broker.db'}", f"db+sqlite:///{var_dir / 'results.db'}"


def make_celery(settings: Settings | None = None) -> Celery:
    """A Celery app for `settings` (default: the environment's)."""
    settings = settings or get_settings()
    settings.var_dir.resolve().mkdir(parents=True, exist_ok=True)  # broker files, beat schedule
    broker, backend = broker_urls(settings)
    app = Celery("exitplane", broker=broker, backend=backend, include=TASK_MODULES)
    app.conf.update(
        task_default_queue=QUEUE,
        task_serializer="json", result_serializer="json", accept_content=["json"],
        timezone="UTC", enable_utc=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_time_limit=600, task_soft_time_limit=540,
        result_expires=86400,
        broker_connection_retry_on_startup=True,
        # Redis: a task not acknowledged within an hour is handed to another worker.
        broker_transport_options={"visibility_timeout": 3600} if settings.redis_url else {},
        worker_hijack_root_logger=False,
        beat_schedule_filename=str(settings.var_dir.resolve() / "celerybeat-schedule"),
        beat_schedule={
            "drift-check": {"task": "drift.detect_all", "schedule": settings.drift_interval_s,
                            "options": {"expires": settings.drift_interval_s}},
            "stale-runtimes": {"task": "runtimes.check_stale",
                               "schedule": max(15.0, settings.runtime_stale_after_s / 4),
                               "options": {"expires": 60}},
            "retention": {"task": "retention.run", "schedule": crontab(hour=3, minute=17)},
            "delivery-sweep": {"task": "alerts.sweep", "schedule": 300.0,
                               "options": {"expires": 300}},
            "canary-evaluate": {"task": "canary.evaluate_all",
                                "schedule": settings.canary_interval_s,
                                "options": {"expires": settings.canary_interval_s}},
            "calibration-sweep": {"task": "calibration.sweep", "schedule": 300.0,
                                  "options": {"expires": 300}},
            "operating-curve": {"task": "curve.refresh_all",
                                "schedule": settings.operating_curve_interval_s,
                                "options": {"expires": settings.operating_curve_interval_s}},
            "shadow-rate": {"task": "shadow_rate.decide_all",
                            "schedule": settings.drift_interval_s,
                            "options": {"expires": settings.drift_interval_s}},
        },
    )
    return app


app = make_celery()
