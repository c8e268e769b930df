"""Shared fixtures: a real database per test (SQLite always, PostgreSQL when provisioned),
built by the migrations, and API clients with tokens of each scope."""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings
from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from controlplane.db import make_engine
from controlplane.migrate import upgrade
from controlplane.models import Base

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

POSTGRES_URL = os.environ.get("EXITPLANE_TEST_POSTGRES_URL", "")
REDIS_URL = os.environ.get("EXITPLANE_TEST_REDIS_URL", "")
BACKENDS = ["sqlite"] + (["postgresql"] if POSTGRES_URL else [])
if os.environ.get("CI") and not POSTGRES_URL:
    raise RuntimeError("CI must run against PostgreSQL: set EXITPLANE_TEST_POSTGRES_URL "
                       "(scripts/services.sh start writes it)")


@pytest.fixture(autouse=True, scope="session")
def alert_reactions() -> None:
    """The alert reactions every process installs when it starts (`create_app`, `workers.app`):
    a test that fires alerts through the services gets the automatic fallback, as production
    does (tests/controlplane/alerts/test_reactions.py checks what each start installs)."""
    from controlplane.calibration import fallback

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


@contextlib.contextmanager
def migrated_postgres_database(prefix: str) -> Iterator[str]:
    """A database of its own on the test server (parallel runs don't meet), migrated, and
    dropped on exit."""
    from sqlalchemy.engine import make_url

    if not POSTGRES_URL:
        raise RuntimeError("this test needs PostgreSQL: run `make test`, or set "
                           "EXITPLANE_TEST_POSTGRES_URL (scripts/services.sh start writes it)")
    base = make_url(POSTGRES_URL)
    name = f"{prefix}{os.getpid()}_{int(time.time())}"
    admin = make_engine(base.set(database="postgres").render_as_string(hide_password=False))
    with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    url = base.set(database=name).render_as_string(hide_password=False)
    try:
        upgrade(url)
        yield url
    finally:
        with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


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


# Empty every table and restart every id sequence, as `TRUNCATE ... RESTART IDENTITY` would:
# tests rely on ids starting at 1. DELETE in reverse dependency order costs next to nothing on
# the few rows a test leaves, where TRUNCATE rewrites the files of all tables (77 ms against
# 4 ms per test on this machine, for each of the hundreds of PostgreSQL tests).
_EMPTY_POSTGRES = "; ".join(
    [f"DELETE FROM {table.name}" for table in reversed(Base.metadata.sorted_tables)]
    + ["SELECT setval(oid, 1, false) FROM pg_class WHERE relkind = 'S'"])


def empty_postgres(url: str) -> None:
    """Every table of the PostgreSQL database at `url` emptied, every id sequence restarted."""
    engine = make_engine(url)
    with engine.begin() as connection:
        connection.exec_driver_sql(_EMPTY_POSTGRES)
    engine.dispose()


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


def wait_until(predicate, timeout: float = 20.0, message: str = "condition",
               interval: float = 0.05):
    """Poll `predicate` until it returns something truthy, and return that; fail the test
    after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {message}")
        time.sleep(interval)


def patient_get(client, url: str, **kwargs):
    """GET `url` as a well-behaved client polls: a 429 waits its Retry-After (at most 2 s) and
    asks again, for up to a minute. `client`: a TestClient, an httpx client or `httpx`."""
    deadline = time.monotonic() + 60
    while True:
        answer = client.get(url, **kwargs)
        if answer.status_code != 429 or time.monotonic() > deadline:
            return answer
        time.sleep(min(2.0, float(answer.headers.get("Retry-After", 1))))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_processes(processes: list[subprocess.Popen], timeout: float = 30.0) -> None:
    """SIGTERM to each (all first, so that they shut down side by side), then SIGKILL to any
    that has not exited `timeout` seconds later."""
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def stop_process(process: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited after `timeout` seconds."""
    stop_processes([process], timeout)


def serve_in_thread(server) -> threading.Thread:
    """Run a `socketserver` server's `serve_forever` in a daemon thread. It checks for
    `shutdown()` every 20 ms: at the default 0.5 s every test that stops a receiver waited
    half a second in its teardown."""
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02},
                              daemon=True)
    thread.start()
    return thread


@dataclass
class LiveServer:
    url: str
    server: object
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def live_server(app) -> Iterator[LiveServer]:
    """The app served by a real uvicorn on a loopback port, in a thread."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    live = LiveServer(url=f"http://127.0.0.1:{port}", server=server, thread=thread)
    yield live
    live.stop()


def quick_hasher():
    """Argon2 with minimal cost: tests that sign people in check who gets in, not the hash's
    strength."""
    from argon2 import PasswordHasher

    return PasswordHasher(time_cost=1, memory_cost=1024, parallelism=1)


@pytest.fixture
def quick_hashing(monkeypatch):
    """Users' passwords hashed by `quick_hasher` for the test."""
    from controlplane.auth import users

    monkeypatch.setattr(users, "_hasher", quick_hasher())


# -- Celery workers ------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
_worker_names = itertools.count(1)


class CeleryWorker:
    """`celery worker` (solo pool, as the tests' one-process stacks need) in a subprocess, on
    the store and broker that env names; its output goes to log."""

    def __init__(self, *, env: dict[str, str], log: Path, name: str = "worker") -> None:
        self.log = log
        # A node name of its own per process and worker: two test sessions on one broker
        # never see each other's workers as duplicates.
        node = f"{name}-{os.getpid()}-{next(_worker_names)}@localhost"
        with log.open("a") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "workers.app", "worker",
                 "--pool=solo", "--loglevel=INFO", "--without-gossip", "--without-mingle",
                 "--without-heartbeat", "-n", node],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60.0) -> CeleryWorker:
        """Return once the worker consumes tasks; raise with its log if it died or hung."""
        deadline = time.monotonic() + timeout
        while "ready." not in self.log.read_text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"celery worker did not start:\n{self.log.read_text()}")
            time.sleep(0.2)
        return self

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM (a warm shutdown: the running task finishes), then SIGKILL after timeout."""
        if self.process.poll() is None:
            stop_process(self.process, timeout)


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
