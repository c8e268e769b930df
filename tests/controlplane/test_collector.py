"""The API's garbage-collection policy: full passes on a schedule, not whenever Python likes."""

from __future__ import annotations

import asyncio
import gc

from controlplane import collector


def _automatic_full_passes() -> int:
    """Full passes Python starts by itself while the process allocates and keeps 1.5 million
    containers (what survives piles up in the old generation)."""
    passes: list[int] = []

    def note(phase: str, info: dict) -> None:
        if phase == "stop" and info["generation"] == 2:
            passes.append(1)

    gc.callbacks.append(note)
    try:
        kept = [[index] for index in range(1_500_000)]
    finally:
        gc.callbacks.remove(note)
    del kept
    return len(passes)


def test_full_collections_run_on_the_schedule_and_the_thresholds_come_back():
    before = gc.get_threshold()
    assert _automatic_full_passes() >= 1  # Python's own policy, for comparison
    timed: list[int] = []

    def note(phase: str, info: dict) -> None:
        if phase == "stop" and info["generation"] == 2:
            timed.append(1)

    async def scenario() -> tuple[tuple[int, int, int], int]:
        async with collector.scheduled_full_collections(0.1):
            inside = gc.get_threshold()
            automatic = _automatic_full_passes()
            gc.callbacks.append(note)
            try:
                # every 0.1 s; a full pass of a big, loaded test process may take longer
                for _ in range(100):
                    if len(timed) >= 2:
                        break
                    await asyncio.sleep(0.1)
            finally:
                gc.callbacks.remove(note)
            return inside, automatic

    inside, automatic = asyncio.run(scenario())
    assert inside[2] == collector.NEVER and inside[:2] == before[:2]
    assert automatic == 0  # no full pass of Python's own while scheduled
    assert len(timed) >= 2  # the schedule's
    assert gc.get_threshold() == before


def test_overlapping_apps_restore_the_thresholds_once_the_last_one_ends():
    before = gc.get_threshold()

    async def scenario() -> None:
        first = collector.scheduled_full_collections(30)
        second = collector.scheduled_full_collections(30)
        await first.__aenter__()
        await second.__aenter__()
        await first.__aexit__(None, None, None)
        assert gc.get_threshold()[2] == collector.NEVER  # the second app still runs
        await second.__aexit__(None, None, None)

    asyncio.run(scenario())
    assert gc.get_threshold() == before


def test_zero_keeps_pythons_policy():
    before = gc.get_threshold()

    async def scenario() -> tuple[int, int, int]:
        async with collector.scheduled_full_collections(0):
            return gc.get_threshold()

    assert asyncio.run(scenario()) == before
