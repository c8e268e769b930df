"""The Celery app of the worker and beat processes:

    celery -A workers.app worker --pool=solo      # or: exitplane worker
    celery -A workers.app beat                    # or: exitplane beat

It is the control plane's app (`controlplane.celery_app`: configuration, beat schedule, the
broker the outbox sends through) with what only these processes need: the worker-side
logging, request-id and metrics signals, the liveness promises probes read, and the alert
reactions, so that an alert a task fires gets the automatic fallback.
"""

from __future__ import annotations

from celery import signals

from controlplane.celery_app import app
from controlplane.flows import fallback
from workers import observability  # noqa: F401  (logging, request ids and metrics signals)
from workers.liveness import install as install_liveness

fallback.install()
install_liveness(app)  # EXITPLANE_HEARTBEAT_FILE, for liveness probes


@signals.worker_init.connect
def load_distribution_tests(**_kwargs) -> None:
    """Import Evidently, pandas and scipy as the worker starts, before it takes a task (a
    prefork pool's children inherit them), not inside its first drift check: the import takes
    5-6 CPU-seconds on a slow core, which delayed that check and took the core from the rest
    of a busy box at that moment. The API and beat processes never import them."""
    import controlplane.drift.evidently_drift  # noqa: F401

__all__ = ["app"]
