"""The Celery app of the worker and beat processes:

    celery -A workers.app worker --pool=solo      # or: exitplane worker
    celery -A workers.app beat                    # or: exitplane beat

It is the control plane's app (`controlplane.celery_app`: configuration, beat schedule, the
broker the outbox sends through) with what only these processes need: the worker-side
logging, request-id and metrics signals, and the alert reactions, so that an alert a task
fires gets the automatic fallback.
"""

from __future__ import annotations

from controlplane.calibration import fallback
from controlplane.celery_app import app
from workers import observability  # noqa: F401  (logging, request ids and metrics signals)

fallback.install()

__all__ = ["app"]
