"""Readiness of an API process (what a load balancer's probe asks), the deep check of what it
depends on (what an operator or a monitor asks), and what a 503 for a store error says."""

from __future__ import annotations

from anyio import to_thread
from fastapi.responses import JSONResponse
from sqlalchemy import text
from sqlalchemy.engine import Engine

from controlplane.migrate import UPGRADE_HINT, not_migrated, stored_revisions


class Readiness:
    """An API process is ready once the store has answered it with a schema this release serves
    (at the migrations' head) since it started; from then on it has what it serves pulls from
    (its caches of tokens and threshold sets) and answers what needs the store with 503 and
    Retry-After, which runtimes retry and spool on. Until then every API call would fail, so a
    store that has no schema yet, or one behind this release, keeps the process unready.

    A store or Redis outage reaches every replica at once, so it does not make a process
    unready: taking every pod out of the Service together would turn those 503s into refused
    connections and the pulls the caches still answer into failures. `deep` asks both now."""

    def __init__(self, engine: Engine, redis_client=None) -> None:
        self._engine = engine
        self._redis = redis_client
        # Once seen at head the schema is not asked again: the probe stays one cheap check.
        self.schema_current = False

    def _check_store(self) -> str | None:
        """Ask the store now: None when it answers with a schema this release serves, else why
        it cannot serve it (`schema not migrated: ...`). Raises when the store does not answer."""
        with self._engine.connect() as connection:
            if self.schema_current:
                connection.execute(text("SELECT 1"))
                return None
            problem = not_migrated(stored_revisions(connection))
        self.schema_current = problem is None
        return problem

    async def ready(self) -> JSONResponse:
        """200 once the store has answered this process with a current schema; until then 503
        with Retry-After, saying whether the store has not answered or its schema is behind."""
        if not self.schema_current:
            try:
                problem = await to_thread.run_sync(self._check_store)
            except Exception as error:  # not yet reached: nothing to serve from
                return _unavailable(f"the store has not answered this process yet "
                                    f"({type(error).__name__})")
            if problem:
                return _unavailable(problem)
        return JSONResponse({"status": "ready"})

    async def deep(self) -> JSONResponse:
        """200 while the store (with a current schema) and Redis (when configured) answer now;
        else 503 naming the error or the schema's revision."""
        def check() -> str | None:
            problem = self._check_store()
            if self._redis is not None:
                self._redis.ping()
            return problem

        try:
            problem = await to_thread.run_sync(check)
        except Exception as error:  # any failure to reach either means not ready
            return _unavailable(type(error).__name__)
        return _unavailable(problem) if problem else JSONResponse({"status": "ready"})


def store_unavailable_detail(error: BaseException) -> str:
    """What a 503 for a store error (`controlplane.db.store_away`) says: the schema not migrated
    when a table or column this release uses is missing (and what to run), else the store away
    or busy."""
    if _schema_missing(error):
        return (f"schema not migrated: the store lacks a table or column this release uses; "
                f"{UPGRADE_HINT}")
    return "the store is unavailable; retry shortly"


def _schema_missing(error: BaseException) -> bool:
    """Whether `error` is PostgreSQL's undefined table or column, or SQLite's "no such ..."."""
    raised = getattr(error, "orig", None) or error
    if getattr(raised, "sqlstate", None) in ("42P01", "42703"):
        return True
    return type(raised).__module__ == "sqlite3" and \
        str(raised).startswith(("no such table", "no such column"))


def _unavailable(detail: str) -> JSONResponse:
    return JSONResponse(status_code=503, headers={"Retry-After": "2"},
                        content={"status": "unavailable", "detail": detail})
