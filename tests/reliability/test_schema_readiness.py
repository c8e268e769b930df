"""An API process on a store whose schema is not at this release's head (none yet, or an older
revision) is not ready: `/readyz` and `/readyz?deep=true` answer 503 "schema not migrated" with
what to run, and so does every API call, until `exitplane db upgrade` has run. The probe asks
the store's revision only until it has seen the head. `exitplane db current` exits 1 on such a
store and 0 at head."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text
from sqlalchemy.engine import make_url

from controlplane import health
from controlplane.db import make_engine
from controlplane.migrate import head_revisions, upgrade
from controlplane.settings import Settings
from exitplane.app import create_app
from tests.support.services import POSTGRES_URL

EXITPLANE = str(Path(sys.executable).parent / "exitplane")
OLDER = "0008_segment_traffic"  # a revision half-way through the migrations
BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]


@pytest.fixture(params=BACKENDS)
def empty_store(request, tmp_path) -> Iterator[str]:
    """The URL of a store that has no schema yet: a new SQLite file, or a new PostgreSQL
    database on the test server."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'exitplane.db'}"
        return
    if not POSTGRES_URL:
        raise RuntimeError("this test needs PostgreSQL: run `make test`, or set "
                           "EXITPLANE_TEST_POSTGRES_URL (scripts/services.sh start writes it)")
    base = make_url(POSTGRES_URL)
    name = f"exitplane_schema{os.getpid()}_{time.time_ns()}"
    admin = make_engine(base.set(database="postgres").render_as_string(hide_password=False))
    with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield base.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def api(empty_store, tmp_path) -> Iterator[TestClient]:
    """The API on `empty_store`, started (its lifespan run)."""
    engine = make_engine(empty_store)
    settings = Settings(database_url=empty_store, var_dir=tmp_path / "var")
    try:
        with TestClient(create_app(settings, engine=engine)) as client:
            yield client
    finally:
        engine.dispose()


def _not_migrated(answer) -> str:
    assert answer.status_code == 503, answer.text
    assert answer.headers["retry-after"] == "2"
    detail = answer.json()["detail"]
    assert detail.startswith("schema not migrated: ") and "`exitplane db upgrade`" in detail
    return detail


def test_an_empty_store_keeps_the_api_unready_until_upgraded(api, empty_store, monkeypatch):
    asked = []
    stored_revisions = health.stored_revisions

    def counted(connection):
        asked.append(1)
        return stored_revisions(connection)

    monkeypatch.setattr(health, "stored_revisions", counted)
    bearer = {"Authorization": "Bearer ep_not_a_token"}

    assert "no schema yet" in _not_migrated(api.get("/readyz"))
    assert "no schema yet" in _not_migrated(api.get("/readyz", params={"deep": "true"}))
    _not_migrated(api.get("/v1/deployments", headers=bearer))
    _not_migrated(api.get("/v1/deployments/chat/thresholds", params={"runtime_id": "rt-1"},
                          headers=bearer))
    _not_migrated(api.get("/readyz"))
    assert len(asked) == 3  # asked again on every probe while not ready

    upgrade(empty_store)
    assert api.get("/readyz").json() == {"status": "ready"}
    assert api.get("/readyz", params={"deep": "true"}).json() == {"status": "ready"}
    assert api.get("/v1/deployments", headers=bearer).status_code == 401  # the store answers
    for _ in range(3):
        assert api.get("/readyz").status_code == 200
    assert len(asked) == 4  # the head, once seen, is not asked for again


def test_a_store_at_an_older_revision_is_not_ready(api, empty_store):
    upgrade(empty_store, OLDER)
    head = ", ".join(sorted(head_revisions()))
    for answer in (api.get("/readyz"), api.get("/readyz", params={"deep": "true"})):
        assert f"the store is at {OLDER}, this release needs {head}" in _not_migrated(answer)

    upgrade(empty_store)
    assert api.get("/readyz").status_code == 200
    assert api.get("/readyz", params={"deep": "true"}).status_code == 200


@pytest.mark.slow  # runs the CLI's process
def test_db_current_exits_nonzero_until_the_store_is_at_head(empty_store, tmp_path):
    env = {**os.environ, "EXITPLANE_DATABASE_URL": empty_store,
           "EXITPLANE_VAR_DIR": str(tmp_path / "var")}

    def current() -> subprocess.CompletedProcess:
        return subprocess.run([EXITPLANE, "db", "current"], env=env, capture_output=True,
                              text=True, timeout=120)

    empty = current()
    assert empty.returncode == 1 and empty.stdout == ""
    assert empty.stderr.count("\n") == 1 and "schema not migrated" in empty.stderr
    assert "no schema yet" in empty.stderr and "`exitplane db upgrade`" in empty.stderr

    upgrade(empty_store, OLDER)
    behind = current()
    assert behind.returncode == 1 and behind.stdout == f"{OLDER}\n"
    assert behind.stderr.count("\n") == 1 and f"the store is at {OLDER}" in behind.stderr

    upgrade(empty_store)
    (head,) = head_revisions()
    at_head = current()
    assert at_head.returncode == 0, at_head.stderr
    assert at_head.stdout == f"{head} (head)\n" and at_head.stderr == ""
