"""Metered reads: the metering layer settles a read (a GET, or a POST that asks in its body)
before its answer goes out (and when its route fails), a settled read owes what it kept the API
busy past what it took, and a token's heavy reads take turns."""

from __future__ import annotations

import asyncio

import pytest

from controlplane.guards import reads
from controlplane.guards.buckets import LocalRateLimiter
from controlplane.guards.reads import READ_METER, ReadMeter, ReadMetering, Turns


class _Meter:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    async def settle(self) -> None:
        self.events.append("settled")


def _served(route, method: str = "GET") -> list[str]:
    events: list[str] = []

    async def send(message) -> None:
        events.append(message["type"])

    async def receive():
        return {"type": "http.disconnect"}

    async def serve() -> None:
        scope = {"type": "http", "method": method}
        await ReadMetering(lambda s, r, w: route(s, w, events))(scope, receive, send)

    try:
        asyncio.run(serve())
    except RuntimeError as error:
        events.append(str(error))
    return events


async def _answers(scope, send, events) -> None:
    scope[READ_METER] = _Meter(events)
    await send({"type": "http.response.start", "status": 200})
    await send({"type": "http.response.body", "body": b"{}"})


async def _fails(scope, send, events) -> None:
    scope[READ_METER] = _Meter(events)
    raise RuntimeError("the route failed")


def test_a_read_is_settled_before_its_answer_goes_out():
    assert _served(_answers)[:2] == ["settled", "http.response.start"]


def test_a_read_whose_route_fails_is_settled():
    assert _served(_fails) == ["settled", "the route failed"]


def test_a_read_sent_as_a_post_is_settled_too():
    """A what-if asks its question in a POST body: it is metered and settled like a GET."""
    assert _served(_answers, method="POST")[:2] == ["settled", "http.response.start"]


def test_other_methods_pass_through():
    events = _served(_answers, method="PUT")
    assert events == ["http.response.start", "http.response.body"]


def test_a_settled_read_owes_its_time_past_what_it_took(monkeypatch):
    monkeypatch.setattr(reads, "READ_UNIT_S", 1e-6)
    limiter = LocalRateLimiter(1.0)  # a burst of 2
    meter = ReadMeter("7", heavy=False)
    meter.limiter, meter.taken, meter.started = limiter, 1, 0.0  # busy since the clock began
    asyncio.run(meter.settle())
    asyncio.run(meter.settle())  # once only
    assert limiter.take("7") is not None
    assert limiter.take("8") is None


def test_heavy_reads_take_turns_and_a_full_queue_is_refused():
    async def scenario() -> tuple[list[bool], int]:
        turns = Turns(at_once=1, waiting=2)
        assert await turns.take("t")
        waiting = [asyncio.create_task(turns.take("t")) for _ in range(2)]
        await asyncio.sleep(0)
        refused = await turns.take("t")  # one running, two waiting
        other = await turns.take("u")  # another token's read runs beside them
        for _ in range(3):
            turns.give_back("t")
            await asyncio.sleep(0)
        return [refused, other, *[await task for task in waiting]], turns.holders("t")

    taken, left = asyncio.run(scenario())
    assert taken == [False, True, True, True] and left == 0


@pytest.mark.parametrize("heavy", [False, True])
def test_the_unit_owed_follows_the_read_kind(heavy, monkeypatch):
    owed: list[float] = []

    class Limiter:
        async def owe(self, key: str, cost: float) -> None:
            owed.append(cost)

    monkeypatch.setattr(reads.time, "monotonic", lambda: 1.0)
    meter = ReadMeter("7", heavy=heavy)
    meter.limiter, meter.taken, meter.started = Limiter(), 0, 0.0
    asyncio.run(meter.settle())
    assert owed == [1.0 / (reads.HEAVY_READ_UNIT_S if heavy else reads.READ_UNIT_S)]
