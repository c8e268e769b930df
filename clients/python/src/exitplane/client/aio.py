"""`AsyncRuntime`: the `Runtime` facade for an asyncio server, with the same public surface.

The pulling, shipping and file watching stay on the Runtime's threads; nothing here blocks the
event loop. What blocks on `Runtime` (`start`, `wait_ready`, `flush`, `heartbeat`, `close`)
is a coroutine here, run in a worker thread (`asyncio.to_thread`); listeners may be coroutine
functions, run on the loop that started the runtime. Everything else (the configuration, the
applied set, `record`, `should_shadow`, `draw_shadow_request`, `exit_layer`, `metrics`, ...) is
the wrapped Runtime's own attribute, read and called as on `Runtime`.

    async with AsyncRuntime.from_env(num_layers=30, exit_layers=[8, 16, 24]) as rt:
        ...
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

from exitplane.client.runtime import Runtime


class _Shared:
    """An attribute of the wrapped Runtime, read and set through the AsyncRuntime."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        on_runtime = vars(Runtime).get(name)  # a method or property; else an instance attribute
        self.__doc__ = on_runtime.__doc__ if on_runtime is not None else f"The Runtime's `{name}`."

    def __get__(self, instance: AsyncRuntime | None, owner: type | None = None) -> Any:
        if instance is None:
            return self
        return getattr(instance.runtime, self.name)

    def __set__(self, instance: AsyncRuntime, value: Any) -> None:
        setattr(instance.runtime, self.name, value)


class AsyncRuntime:
    """A `Runtime` driven from asyncio; see the module docstring."""

    # the Runtime's configuration and parts
    deployment = _Shared()
    runtime_id = _Shared()
    num_layers = _Shared()
    exit_layers = _Shared()
    shadow_rate = _Shared()
    local_shadow_rate = _Shared()
    shadow_rate_source = _Shared()
    shadow_request_rate = _Shared()
    local_shadow_request_rate = _Shared()
    shadow_request_rate_source = _Shared()
    shadow_requests = _Shared()
    applies_segments = _Shared()
    head_digest = _Shared()
    model_revision = _Shared()
    leave_on_close = _Shared()
    offline_file = _Shared()
    token_file = _Shared()
    url = _Shared()
    thresholds = _Shared()
    shipper = _Shared()
    # the decode loop's non-blocking side
    threshold_set = _Shared()
    version = _Shared()
    thresholds_for = _Shared()
    should_shadow = _Shared()
    draw_shadow_request = _Shared()
    exit_layer = _Shared()
    shadow = _Shared()
    record = _Shared()
    dropped_offline = _Shared()
    metrics = _Shared()

    def __init__(self, runtime: Runtime | None = None, **options: Any) -> None:
        """Wrap `runtime`, or build one from `options` (the `Runtime` keywords)."""
        self.runtime = runtime if runtime is not None else Runtime(**options)
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def from_env(cls, **overrides: Any) -> AsyncRuntime:
        """`Runtime.from_env`, wrapped."""
        return cls(Runtime.from_env(**overrides))

    # -- listeners -------------------------------------------------------------------------
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
        """As `Runtime.on_refused`; a coroutine function runs on the event loop."""
        self.runtime.on_refused(self._listener(listener))
        return listener

    def on_error(self, listener: Callable) -> Callable:
        """As `Runtime.on_error`; a coroutine function runs on the event loop."""
        self.runtime.on_error(self._listener(listener))
        return listener

    # -- what blocks on Runtime, off the loop -----------------------------------------------
    async def start(self, ready_timeout: float | None = 30.0) -> AsyncRuntime:
        """Start the runtime and wait (off the loop) until a set is applied."""
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self.runtime.start, ready_timeout)
        return self

    async def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait (off the loop) until a set is applied, as `Runtime.wait_ready`."""
        return await asyncio.to_thread(self.runtime.wait_ready, timeout)

    async def close(self, timeout: float = 30.0, *, leave: bool | None = None) -> None:
        """Ship what is left, stop and leave the fleet, off the loop."""
        await asyncio.to_thread(self.runtime.close, timeout, leave=leave)

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait (off the loop) until every token reported so far is delivered, refused or
        spooled."""
        return await asyncio.to_thread(self.runtime.flush, timeout)

    async def heartbeat(self) -> bool:
        """Send a heartbeat now, off the loop."""
        return await asyncio.to_thread(self.runtime.heartbeat)

    async def __aenter__(self) -> AsyncRuntime:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
