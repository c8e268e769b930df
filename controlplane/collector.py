"""The API process's garbage-collection policy (the pull tail at fleet load).

CPython's collector stops every thread while it runs, and a full (generation 2) pass costs in
proportion to everything the process holds. Measured at fleet load (bench/fleet.py, 1,000
runtimes, 2 API processes on 2 cores; `exitplane_gc_pause_seconds`): with the default policy
each API process ran a full pass every ~5 s, each pausing it 30-400 ms (the startup objects:
~256,000; what a thousand held long-polls and the requests in flight keep: ~80,000 after the
pull fast path), which was the tail of every request that arrived meanwhile.

Two changes, both made once the app has started:
- `gc.freeze()` moves what is alive then (modules, routes, schemas: most of the process) out
  of the collector's view for good; it is never garbage.
- With `interval_s` > 0 automatic full passes are turned off (the third threshold out of
  reach) and one runs every `interval_s` seconds instead: the young generations are still
  collected as usual, so only cycles that survived into the old generation wait, at most
  `interval_s`, for it. One pause a minute instead of a dozen touches ~0.2% of requests
  rather than a few percent. 0 keeps Python's own policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc

NEVER = 2**31 - 1  # a generation-2 threshold the collector never reaches
_scheduled = 0  # apps of this process inside `scheduled_full_collections`
_previous = gc.get_threshold()


def freeze_startup() -> None:
    """Collect once, then move every object alive to the permanent generation (once per
    process: an app built again in the same process, as in tests, adds nothing)."""
    if gc.get_freeze_count() == 0:
        gc.collect()
        gc.freeze()


@contextlib.asynccontextmanager
async def scheduled_full_collections(interval_s: float):
    """For the life of the block: full collections every `interval_s` seconds instead of
    Python's automatic ones (module docstring); the previous thresholds come back when the
    last such block of the process ends."""
    global _scheduled, _previous
    if interval_s <= 0:
        yield
        return
    if _scheduled == 0:  # apps may overlap in one process (tests): the first one sets it
        _previous = gc.get_threshold()
        gc.set_threshold(_previous[0], _previous[1], NEVER)
    _scheduled += 1

    async def collect_periodically() -> None:
        while True:
            await asyncio.sleep(interval_s)
            gc.collect(2)

    task = asyncio.create_task(collect_periodically())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        _scheduled -= 1
        if _scheduled == 0:  # and the last one puts Python's thresholds back
            gc.set_threshold(*_previous)
