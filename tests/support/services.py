"""The PostgreSQL and Redis the suite runs on (scripts/services.sh start provisions them), and
PostgreSQL databases of a test's own."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

from sqlalchemy import text

from controlplane.db import make_engine
from controlplane.migrate import upgrade
from controlplane.models import Base

POSTGRES_URL = os.environ.get("EXITPLANE_TEST_POSTGRES_URL", "")
REDIS_URL = os.environ.get("EXITPLANE_TEST_REDIS_URL", "")
BACKENDS = ["sqlite"] + (["postgresql"] if POSTGRES_URL else [])


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
