"""Shared fixtures: a real database per test (SQLite always, PostgreSQL when provisioned),
built by the migrations, and API clients with tokens of each scope."""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from controlplane.db import make_engine
from controlplane.migrate import upgrade
from tests.support.network import LiveServer, start_server
from tests.support.people import quick_hasher
from tests.support.processes import CeleryWorker
from tests.support.services import (
    BACKENDS,
    POSTGRES_URL,
    empty_postgres,
    migrated_postgres_database,
)

# Fixtures that tests in several folders use, each defined once in tests/support.
pytest_plugins = [
    "tests.support.alerts",
    "tests.support.postgres",
    "tests.support.redis",
    "tests.support.runtime_link",
]

# The machine is shared with model training; wall-clock deadlines would only add flakiness.
hypothesis_settings.register_profile("exitplane", deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
hypothesis_settings.load_profile("exitplane")

# One secret key for the test session and every process it starts, as production shares one
# between API, workers and CLI: hook credentials encrypted by one must decrypt in another.
os.environ.setdefault("EXITPLANE_SECRET_KEY", secrets.token_urlsafe(48))
# The hook tests post to receivers on loopback (hooks reach no internal address
# unless it is allow-listed); tests/security/test_hook_ssrf.py checks with an empty list.
os.environ.setdefault("EXITPLANE_HOOK_ALLOWED_HOSTS", "127.0.0.1")

if os.environ.get("CI") and not POSTGRES_URL:
    raise RuntimeError("CI must run against PostgreSQL: set EXITPLANE_TEST_POSTGRES_URL "
                       "(scripts/services.sh start writes it)")


@pytest.fixture(autouse=True, scope="session")
def alert_reactions() -> None:
    """The alert reactions every process installs when it starts (`create_app`, `workers.app`):
    a test that fires alerts through the services gets the automatic fallback, as production
    does (tests/controlplane/alerts/test_reactions.py checks what each start installs)."""
    from controlplane.flows import fallback

    fallback.install()


@pytest.fixture
def outbox(monkeypatch) -> list[tuple[str, list]]:
    """Celery tasks the services hand to the broker after commit (`controlplane.outbox`),
    recorded instead of sent: no worker runs, and the process-wide broker is not this test's
    database's."""
    sent: list[tuple[str, list]] = []
    monkeypatch.setattr("controlplane.outbox.send_task",
                        lambda name, args: sent.append((name, list(args))))
    return sent


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory) -> str:
    """A SQLite file migrated once; each test gets a copy."""
    path = tmp_path_factory.mktemp("template") / "template.db"
    upgrade(f"sqlite:///{path}")
    return str(path)


@pytest.fixture(scope="session")
def postgres_migrated() -> Iterator[str]:
    """The test session's migrated PostgreSQL database."""
    with migrated_postgres_database("exitplane_t") as url:
        yield url


@pytest.fixture(params=BACKENDS)
def db_url(request, tmp_path) -> Iterator[str]:
    """A clean, migrated database for one test."""
    if request.param == "sqlite":
        path = tmp_path / "exitplane.db"
        shutil.copy(request.getfixturevalue("sqlite_template"), path)
        yield f"sqlite:///{path}"
        return
    if not POSTGRES_URL:
        raise RuntimeError("this test needs PostgreSQL: run `make test`, or set "
                           "EXITPLANE_TEST_POSTGRES_URL (scripts/services.sh start writes it)")
    url = request.getfixturevalue("postgres_migrated")
    empty_postgres(url)
    yield url


@pytest.fixture
def engine(db_url) -> Iterator[Engine]:
    engine = make_engine(db_url)
    yield engine
    engine.dispose()


@pytest.fixture
def session(engine) -> Iterator[Session]:
    with Session(engine, expire_on_commit=False) as session:
        yield session


@dataclass
class Tokens:
    admin: str
    operator: str

    def headers(self, secret: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {secret}"}


@pytest.fixture
def settings(db_url, tmp_path):
    from controlplane.settings import Settings

    return Settings(database_url=db_url, var_dir=tmp_path / "var", config_cache_ttl_s=0.2)


@pytest.fixture
def app(settings, engine):
    from exitplane.app import create_app

    app = create_app(settings, engine=engine)
    yield app
    app.state.config_delivery.close()
    app.state.heartbeats.close()


@pytest.fixture
def tokens(engine) -> Tokens:
    from controlplane.auth.service import create_token

    with Session(engine) as session:
        _, admin = create_token(session=session, name="test-admin", scope="admin")
        _, operator = create_token(session=session, name="test-operator", scope="operator")
        session.commit()
    return Tokens(admin=admin, operator=operator)


@pytest.fixture
def client(app):
    from fastapi.testclient import TestClient

    with TestClient(app) as client:
        yield client


@pytest.fixture
def live_server(app) -> Iterator[LiveServer]:
    """The app served by a real uvicorn on a loopback port, in a thread."""
    live = start_server(app)
    yield live
    live.stop()


@pytest.fixture
def quick_hashing(monkeypatch):
    """Users' passwords hashed by `quick_hasher` for the test."""
    from controlplane.auth import users

    monkeypatch.setattr(users, "_hasher", quick_hasher())


# -- Celery workers ------------------------------------------------------------------------

@pytest.fixture
def celery_worker(tmp_path) -> Iterator[Callable[..., CeleryWorker]]:
    """Start Celery worker processes (`celery_worker(env, name=...)`), each logging to
    tmp_path/<name>.log; all are stopped when the test ends."""
    started: list[CeleryWorker] = []

    def start(env: dict[str, str], *, name: str = "worker") -> CeleryWorker:
        worker = CeleryWorker(env=env, log=tmp_path / f"{name}.log", name=name)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()
