"""The event-loop lag histogram sees a loop that a blocking call held."""

from __future__ import annotations

import asyncio
import time

from controlplane.observability import event_loop_lag, watch_loop_lag


def _sum() -> float:
    return next(sample.value for metric in event_loop_lag.collect()
                for sample in metric.samples if sample.name.endswith("_sum"))


def test_a_blocked_loop_shows_as_lag():
    before = _sum()

    async def scenario() -> None:
        watcher = asyncio.create_task(watch_loop_lag(period=0.05))
        await asyncio.sleep(0.01)
        time.sleep(0.3)  # a handler that blocks the loop
        await asyncio.sleep(0.12)
        watcher.cancel()

    asyncio.run(scenario())
    assert _sum() - before >= 0.2
