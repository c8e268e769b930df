"""The worker tests' stack: a real Celery worker (a subprocess, solo pool) on this test's store,
with a SQLite broker for SQLite and Redis for PostgreSQL."""

from __future__ import annotations

import os

import pytest

from controlplane.celery_app import make_celery
from controlplane.settings import Settings
from tests.support.processes import ROOT
from tests.support.services import REDIS_URL


def _redis_db(url: str, db: int = 11) -> str:
    """A Redis database of our own, so other suites' workers never take our tasks."""
    return url.rsplit("/", 1)[0] + f"/{db}"


@pytest.fixture
def stack(db_url, tmp_path, monkeypatch, celery_worker):
    """(celery app of this test, worker): SQLite broker for SQLite, Redis for PostgreSQL."""
    redis_url = _redis_db(REDIS_URL) if db_url.startswith("postgresql") and REDIS_URL else ""
    if redis_url:
        import redis

        redis.Redis.from_url(redis_url).flushdb()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EXITPLANE_DATABASE_URL": db_url,
           "EXITPLANE_VAR_DIR": str(tmp_path / "var"), "EXITPLANE_REDIS_URL": redis_url,
           "EXITPLANE_CALIBRATION_MIN_SAMPLES": "500", "EXITPLANE_CALIBRATION_RETRY_S": "1"}
    app = make_celery(Settings(database_url=db_url, var_dir=tmp_path / "var",
                               redis_url=redis_url))
    monkeypatch.setattr("controlplane.outbox.send_task",
                        lambda name, args: app.send_task(name, args=args))
    worker = celery_worker(env).wait_ready()
    yield app, worker
    worker.stop()
