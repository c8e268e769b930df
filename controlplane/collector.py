"""The API process's garbage-collection policy, for a short pull tail at fleet load.

A full collection stops every thread for a time proportional to what the process holds, so
once the app has started `freeze_startup` moves what is alive then out of the collector's view,
and `scheduled_full_collections` replaces automatic full passes with one every `interval_s`
seconds (0 keeps Python's own policy). Why, and what the pauses cost:
docs/concepts/api-process.md.
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
    Python's automatic ones; the previous thresholds come back when the
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
