"""A real Celery worker process (solo pool, not eager mode) runs the tasks end to end, on the
embedded SQLite broker and on Redis: drift detection fires an alert, the worker enqueues its
delivery after the commit, and delivery retries past receiver errors with each attempt logged."""

import os
import shutil
from datetime import timedelta

import pytest
import redis
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from controlplane.alerts import hook_service
from controlplane.alerts.models import Alert, AlertDelivery
from controlplane.celery_app import make_celery
from controlplane.db import make_engine, utcnow
from controlplane.models import Base
from controlplane.settings import Settings
from tests.support.alerts import Phase, make_deployment, send_traffic
from tests.support.services import POSTGRES_URL, REDIS_URL
from tests.support.waiting import wait_until

# slow: a real Celery worker process
pytestmark = pytest.mark.slow


def _redis_url() -> str:
    if not REDIS_URL:
        raise RuntimeError("set EXITPLANE_TEST_REDIS_URL (make test starts Redis)")
    return REDIS_URL.rsplit("/", 1)[0] + "/7"  # a database of its own: others flush /0


@pytest.fixture(params=["embedded", "production"])
def stack(request, tmp_path) -> tuple[str, str]:
    """(database URL, Redis URL): the embedded default (SQLite store, SQLite broker) or the
    production pair (PostgreSQL when provisioned, Redis broker)."""
    if request.param == "embedded":
        return request.getfixturevalue("db_url_sqlite"), ""
    return request.getfixturevalue("db_url_production"), _redis_url()


@pytest.fixture
def db_url_sqlite(tmp_path, sqlite_template) -> str:
    path = tmp_path / "exitplane.db"
    shutil.copy(sqlite_template, path)
    return f"sqlite:///{path}"


@pytest.fixture
def db_url_production(request) -> str:
    if not POSTGRES_URL:
        return request.getfixturevalue("db_url_sqlite")
    url = request.getfixturevalue("postgres_migrated")
    engine = make_engine(url)
    tables = ", ".join(t.name for t in Base.metadata.sorted_tables)
    with engine.begin() as connection:
        connection.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    engine.dispose()
    return url


@pytest.fixture
def engine(stack):
    engine = make_engine(stack[0])
    yield engine
    engine.dispose()


@pytest.fixture
def worker(stack, tmp_path, celery_worker):
    """A worker subprocess on the stack; yields the settings it runs with."""
    db_url, redis_url = stack
    if redis_url:
        redis.Redis.from_url(redis_url).flushdb()
    settings = Settings(database_url=db_url, var_dir=tmp_path / "var", redis_url=redis_url,
                        public_url="http://exitplane.test", delivery_backoff_s=0.2)
    env = {**os.environ, "EXITPLANE_DATABASE_URL": db_url,
           "EXITPLANE_VAR_DIR": str(settings.var_dir), "EXITPLANE_REDIS_URL": redis_url,
           "EXITPLANE_PUBLIC_URL": settings.public_url, "EXITPLANE_DELIVERY_BACKOFF_S": "0.2"}
    started = celery_worker(env)
    yield settings
    started.stop()  # before the flush below
    if redis_url:
        redis.Redis.from_url(redis_url).flushdb()


def test_worker_detects_drift_and_delivers_with_retries(worker, engine, receiver, tmp_path):
    start = (utcnow() - timedelta(minutes=10)).replace(second=0, microsecond=0)
    with Session(engine) as session:
        deployment = make_deployment(session, activated_at=start, delta=0.02)
        send_traffic(session, deployment, start=start, seed=7,
                     phases=[Phase(10, (0.25, 0.4, 0.3), shadow_rate=0.2, mismatch_rate=0.1)])
        hook = hook_service.create_hook(session=session, name="ops", kind="webhook",
                                        url=receiver.url + "/hook", actor="test",
                                        min_severity="critical")
        session.commit()
        deployment_id, hook_id = deployment.id, hook.id
    receiver.statuses.extend([500, 503])
    app = make_celery(worker)

    result = app.send_task("drift.detect", args=[deployment_id]).get(timeout=120)
    with Session(engine) as session:
        fired = session.scalars(select(Alert).where(Alert.id.in_(result["fired"]))).all()
    assert [a.kind for a in fired] == ["quality_regression"]
    alert_id = fired[0].id

    # The worker enqueued the delivery after its commit; the receiver fails twice, then takes it.
    wait_until(lambda: len(receiver.requests) >= 3, 90, "three delivery attempts")
    with Session(engine) as session:
        wait_until(lambda: session.scalars(select(AlertDelivery).where(
            AlertDelivery.ok.is_(True))).first(), 90, "the successful attempt to be logged")
        log = session.scalars(select(AlertDelivery).where(
            AlertDelivery.alert_id == alert_id).order_by(AlertDelivery.id)).all()
    assert [(d.hook_id, d.event, d.attempt, d.status_code, d.ok) for d in log] == [
        (hook_id, "firing", 1, 500, False), (hook_id, "firing", 2, 503, False),
        (hook_id, "firing", 3, 200, True)]
    assert [r.json()["alert"]["id"] for r in receiver.requests] == [alert_id] * 3
    assert receiver.requests[-1].json()["alert"]["url"] == \
        f"http://exitplane.test/ui/alerts/{alert_id}"

    # Running detection again is idempotent: no second alert, nothing re-sent. (The fallback
    # made the conservative set active on the first alert, so the alert is not re-observed.)
    again = app.send_task("drift.detect", args=[deployment_id]).get(timeout=60)
    assert again["fired"] == []
    with Session(engine) as session:
        assert session.get(Alert, alert_id).status == "firing"
    stale = app.send_task("runtimes.check_stale", args=[deployment_id]).get(timeout=60)
    assert stale == {"chat": {"fired": [], "refreshed": [], "resolved": []}}
    retention = app.send_task("retention.run").get(timeout=60)
    assert retention["token_records"] == 0  # nothing is older than the retention period
    assert len(receiver.requests) == 3
