"""Thin, named, idempotent Celery tasks: take ids, open a session, call a plain function."""

from __future__ import annotations

from sqlalchemy.exc import OperationalError

# Store hiccups (a lock timeout, a failover) are retried with exponential backoff and jitter.
RETRY_ON_STORE_ERRORS = {"autoretry_for": (OperationalError,), "retry_backoff": 2,
                         "retry_backoff_max": 60, "retry_jitter": True, "max_retries": 5}
