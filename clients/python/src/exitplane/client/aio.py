"""`AsyncRuntime`: the `Runtime` facade for an asyncio server.

The pulling, shipping and file watching stay on the Runtime's threads; nothing here blocks the
event loop. Start-up, flushes, heartbeats and close run in a worker thread
(`asyncio.to_thread`); listeners may be coroutine functions, run on the loop that started the
runtime; `record`, `should_shadow`, `exit_layer` and the applied set are plain, non-blocking
calls, as on `Runtime`.

    async with AsyncRuntime.from_env(num_layers=30, exit_layers=[8, 16, 24]) as rt:
        ...
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

from exitplane.client.runtime import Runtime


class AsyncRuntime:
    """A `Runtime` driven from asyncio; see the module docstring."""

    def __init__(self, runtime: Runtime | None = None, **options: Any) -> None:
        """Wrap `runtime`, or build one from `options` (the `Runtime` keywords)."""
        self.runtime = runtime if runtime is not None else Runtime(**options)
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def from_env(cls, **overrides: Any) -> AsyncRuntime:
        """`Runtime.from_env`, wrapped."""
        return cls(Runtime.from_env(**overrides))

    def _listener(self, listener: Callable) -> Callable:
        if not inspect.iscoroutinefunction(listener):
            return listener

        def on_thread(payload: Any) -> None:  # called on a Runtime thread
            if self._loop is not None and not self._loop.is_closed():
                asyncio.run_coroutine_threadsafe(listener(payload), self._loop)
        return on_thread

    def on_change(self, listener: Callable) -> Callable:
        """As `Runtime.on_change`; a coroutine function runs on the event loop."""
        self.runtime.on_change(self._listener(listener))
        return listener

    def on_refused(self, listener: Callable) -> Callable:
        self.runtime.on_refused(self._listener(listener))
        return listener

    def on_error(self, listener: Callable) -> Callable:
        self.runtime.on_error(self._listener(listener))
        return listener

    async def start(self, ready_timeout: float | None = 30.0) -> AsyncRuntime:
        """Start the runtime and wait (off the loop) until a set is applied."""
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self.runtime.start, ready_timeout)
        return self

    async def close(self, timeout: float = 30.0, *, leave: bool | None = None) -> None:
        """Ship what is left, stop and leave the fleet, off the loop."""
        await asyncio.to_thread(self.runtime.close, timeout, leave=leave)

    async def flush(self, timeout: float | None = None) -> bool:
        return await asyncio.to_thread(self.runtime.flush, timeout)

    async def heartbeat(self) -> bool:
        return await asyncio.to_thread(self.runtime.heartbeat)

    async def __aenter__(self) -> AsyncRuntime:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # the decode loop's non-blocking side, as on Runtime
    @property
    def threshold_set(self):
        return self.runtime.threshold_set

    @property
    def version(self) -> int | None:
        return self.runtime.version

    def thresholds_for(self, segment: str | None = None) -> dict[int, float]:
        return self.runtime.thresholds_for(segment)

    def should_shadow(self) -> bool:
        return self.runtime.should_shadow()

    def exit_layer(self, signals, thresholds):
        return self.runtime.exit_layer(signals, thresholds)

    def shadow(self, signals, matched):
        return self.runtime.shadow(signals, matched)

    def record(self, **token: Any) -> bool:
        return self.runtime.record(**token)

    @property
    def metrics(self) -> dict[str, Any]:
        return self.runtime.metrics
