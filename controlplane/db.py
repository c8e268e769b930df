"""The one definition of the database: declarative Base, engine, session factory and the
request's unit of work (`SessionDep`)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import UTC, datetime
from typing import Annotated, ClassVar

from fastapi import Depends, Request
from sqlalchemy import JSON, DateTime, MetaData, create_engine, event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker
from sqlalchemy.types import TypeDecorator

from controlplane.settings import get_settings

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def store_away(error: BaseException) -> bool:
    """Whether `error` says the store is away or busy, so the same write should be tried again
    later, rather than something about the data written: a lost connection, a pool timeout, a
    deadlock or serialization failure, a schema this process does not match (a deploy under
    way). Raw driver errors (a COPY runs on the driver's connection) count as SQLAlchemy's."""
    away = _dbapi("OperationalError", "InterfaceError", "ProgrammingError", "InternalError")
    return isinstance(error, (*away, sa_exc.TimeoutError, MemoryError)) \
        or bool(getattr(error, "connection_invalidated", False))


def refused_by_store(error: BaseException) -> bool:
    """Whether the store refused the data itself (a value out of range or too long, a
    constraint): writing the same rows again fails the same way."""
    return isinstance(error, (*out_of_range_errors(), *_dbapi("IntegrityError")))


def out_of_range_errors() -> tuple[type[BaseException], ...]:
    """The store refusing a value it cannot hold (a number past 64 bits, text too long for
    its column): SQLAlchemy's DataError, the loaded drivers' own, and OverflowError."""
    return (*_dbapi("DataError"), OverflowError)


def store_errors() -> tuple[type[BaseException], ...]:
    """Every error class the store raises: SQLAlchemy's and the loaded drivers' own (call it
    once the engine exists, so its driver is loaded). What `store_away` and
    `refused_by_store` sort."""
    return (sa_exc.DBAPIError, sa_exc.TimeoutError, *(driver.Error for driver in _drivers()))


def _dbapi(*names: str) -> tuple[type[BaseException], ...]:
    """SQLAlchemy's exception classes of these DB-API names, and the loaded drivers' own."""
    return tuple(getattr(module, name) for name in names for module in (sa_exc, *_drivers()))


def _drivers() -> list:
    return [sys.modules[name] for name in ("psycopg", "sqlite3") if name in sys.modules]


def dialect_insert(session: Session, model):
    """An INSERT of `model` with the session's dialect's ON CONFLICT clauses (PostgreSQL's or
    SQLite's)."""
    if session.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert

        return insert(model)
    from sqlalchemy.dialects.sqlite import insert

    return insert(model)


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator):
    """Timezone-aware UTC datetimes on every backend (SQLite stores naive values)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(UTC) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict] = {datetime: UTCDateTime, dict: JSON, list: JSON}


def _configure_sqlite(engine: Engine) -> None:
    """WAL, a busy timeout, foreign keys, and BEGIN IMMEDIATE so read-modify-write never loses."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:
        dbapi_connection.isolation_level = None  # we emit BEGIN ourselves
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


def make_engine(url: str) -> Engine:
    """An engine for `url` with the per-backend settings exitplane relies on.

    Statement parameters stay out of error messages and SQL logging (`hide_parameters`): the
    store holds webhook HMAC keys in the clear, and a failed INSERT of a hook would otherwise
    carry its secret into the log that reports the failure."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30},
                               hide_parameters=True)
        _configure_sqlite(engine)
        return engine
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20,
                         hide_parameters=True)


_engines: dict[str, Engine] = {}
_lock = threading.Lock()


def get_engine(url: str | None = None) -> Engine:
    """The process-wide engine for `url` (default: the settings' database)."""
    url = url or get_settings().effective_database_url
    with _lock:
        if url not in _engines:
            if url.startswith("sqlite:///"):
                from pathlib import Path

                Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
            _engines[url] = make_engine(url)
        return _engines[url]


def dispose_engines() -> None:
    with _lock:
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()


def session_factory(engine: Engine | None = None) -> sessionmaker[Session]:
    return sessionmaker(bind=engine or get_engine(), expire_on_commit=False)


@contextmanager
def _unit_of_work(session: Session) -> Iterator[Session]:
    """`session` as one unit of work: commit on success, roll back on error, then close."""
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def session_scope(engine: Engine | None = None) -> AbstractContextManager[Session]:
    """A unit of work for workers and the CLI: commit on success, roll back on error."""
    return _unit_of_work(session_factory(engine)())


def get_session(request: Request) -> Iterator[Session]:
    """One unit of work per request: commit when the route returns, roll back on error."""
    with _unit_of_work(request.app.state.session_factory()) as session:
        yield session


# scope="function": the commit happens before the response is sent, so a 2xx means stored.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
