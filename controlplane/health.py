"""Readiness of an API process (what a load balancer's probe asks), and the deep check of what it
depends on (what an operator or a monitor asks)."""

from __future__ import annotations

from anyio import to_thread
from fastapi.responses import JSONResponse
from sqlalchemy import text
from sqlalchemy.engine import Engine


class Readiness:
    """An API process is ready once the store has answered it since it started; from then on it
    has what it serves pulls from (its caches of tokens and threshold sets) and answers what
    needs the store with 503 and Retry-After, which runtimes retry and spool on.

    A store or Redis outage reaches every replica at once, so it does not make a process
    unready: taking every pod out of the Service together would turn those 503s into refused
    connections and the pulls the caches still answer into failures. `deep` asks both now."""

    def __init__(self, engine: Engine, redis_client=None) -> None:
        self._engine = engine
        self._redis = redis_client
        self.store_answered = False

    def _ping_store(self) -> None:
        with self._engine.connect() as connection:
            connection.execute(text("SELECT 1"))
        self.store_answered = True

    async def ready(self) -> JSONResponse:
        """200 once the store has answered this process; until then 503 with Retry-After."""
        if not self.store_answered:
            try:
                await to_thread.run_sync(self._ping_store)
            except Exception as error:  # not yet reached: nothing to serve from
                return _unavailable(f"the store has not answered this process yet "
                                    f"({type(error).__name__})")
        return JSONResponse({"status": "ready"})

    async def deep(self) -> JSONResponse:
        """200 while the store and Redis (when configured) answer now; else 503 naming which."""
        def ping() -> None:
            self._ping_store()
            if self._redis is not None:
                self._redis.ping()

        try:
            await to_thread.run_sync(ping)
        except Exception as error:  # any failure to reach either means not ready
            return _unavailable(type(error).__name__)
        return JSONResponse({"status": "ready"})


def _unavailable(detail: str) -> JSONResponse:
    return JSONResponse(status_code=503, headers={"Retry-After": "2"},
                        content={"status": "unavailable", "detail": detail})
