"""Reads metered by what they cost the API.

A read takes its policy's cost from its token's "read" bucket (EXITPLANE_RATE_LIMIT_READ_PER_S
units a second) before it runs: a lookup by key one unit, a heavy read (a scan of telemetry,
rollups, logs or history, or a report) HEAVY_READ_COST (controlplane/guards/policy.py). Once
answered it also owes what it kept the API busy past what it took, into debt (the token's next
reads wait until it is paid): a light read one unit per READ_UNIT_S, a heavy one a unit per
HEAVY_READ_UNIT_S. At the default rate a token's reads keep an API busy for at most about one
second a second, a quarter of it with heavy reads, whatever the store holds or the query asks
for; one client that reads one thing at a time (pausing three times as long as a heavy read
took after it) never waits. A token runs HEAVY_READS_AT_ONCE heavy reads at once per API
process; HEAVY_READS_WAITING more wait their turn (`Turns`), and past them 429.

`take_read` takes the turn and the cost (the route guard calls it); `ReadMetering`, one ASGI
layer around the app's routes, settles them once the route has answered, before its answer
is sent.
"""

from __future__ import annotations

import asyncio
import time

from starlette.requests import Request

from controlplane.auth.service import Principal
from controlplane.errors import RateLimited
from controlplane.guards.buckets import RateLimiter
from controlplane.guards.policy import RoutePolicy

READ_UNIT_S = 0.01
HEAVY_READ_UNIT_S = 0.0025
HEAVY_READS_AT_ONCE = 1
HEAVY_READS_WAITING = 8
READ_METER = "exitplane.read_meter"  # the scope key of a metered request's `ReadMeter`


class Turns:
    """Per key, at most `at_once` holders at a time in this process; up to `waiting` more wait
    for a turn, first come first served, and past them a request is refused at once. A waiter
    holds nothing but its connection and a place in a queue."""

    def __init__(self, at_once: int = 1, waiting: int = 8) -> None:
        self.at_once, self.waiting = at_once, waiting
        self._keys: dict[str, _Queue] = {}

    async def take(self, key: str) -> bool:
        """Wait for one of `key`'s turns; False (at once) when its queue is full."""
        queue = self._keys.get(key)
        if queue is None:
            queue = self._keys[key] = _Queue(asyncio.Semaphore(self.at_once))
        elif queue.users >= self.at_once + self.waiting:
            return False
        queue.users += 1
        try:
            await queue.semaphore.acquire()
        except BaseException:
            self._leave(key)
            raise
        return True

    def give_back(self, key: str) -> None:
        """End a turn `take` gave."""
        self._keys[key].semaphore.release()
        self._leave(key)

    def holders(self, key: str) -> int:
        """Requests holding or waiting for `key`'s turns."""
        queue = self._keys.get(key)
        return queue.users if queue else 0

    def _leave(self, key: str) -> None:
        queue = self._keys[key]
        queue.users -= 1
        if not queue.users:
            del self._keys[key]


class _Queue:
    __slots__ = ("semaphore", "users")

    def __init__(self, semaphore: asyncio.Semaphore) -> None:
        self.semaphore, self.users = semaphore, 0


class ReadMeter:
    """One metered read: the heavy-read turn it holds and what it took from its token's bucket,
    settled by `settle` once the route has answered (or failed)."""

    __slots__ = ("heavy", "key", "limiter", "started", "taken", "turns")

    def __init__(self, key: str, *, heavy: bool) -> None:
        self.key, self.heavy = key, heavy
        self.turns: Turns | None = None
        self.limiter: RateLimiter | None = None
        self.taken, self.started = 0, 0.0

    async def settle(self) -> None:
        """Give the turn back, then owe what the read cost past what it took (once)."""
        if self.turns is not None:
            self.turns.give_back(self.key)
            self.turns = None
        if self.limiter is None:
            return
        unit = HEAVY_READ_UNIT_S if self.heavy else READ_UNIT_S
        owed = (time.monotonic() - self.started) / unit - self.taken
        limiter, self.limiter = self.limiter, None
        if owed >= 1:
            await limiter.owe(self.key, owed)


async def take_read(request: Request, policy: RoutePolicy, principal: Principal) -> None:
    """Take `principal`'s heavy-read turn (heavy reads) and the read's cost from its token's
    read bucket, or RateLimited (held first where the policy holds refusals); `ReadMetering`
    settles them."""
    state = request.app.state
    meter = request.scope[READ_METER] = ReadMeter(str(principal.token_id), heavy=policy.heavy)
    if policy.heavy:
        turns: Turns = state.heavy_read_turns
        if not await turns.take(meter.key):
            if policy.held:
                await state.refusal_hold()
            raise RateLimited(f"too many heavy reads at once for this token (this process runs "
                              f"{turns.at_once} and queues {turns.waiting}); retry in 1 s",
                              retry_after=1.0)
        meter.turns = turns
    limiter: RateLimiter = state.rate_limiters["read"]
    wait = await limiter.retry_after(meter.key, policy.cost)
    if wait is not None:
        if policy.held:
            await state.refusal_hold()
        raise RateLimited(f"too many reads for this token (this one costs {policy.cost} of "
                          f"EXITPLANE_RATE_LIMIT_READ_PER_S, and more if it keeps the API "
                          f"busy longer); retry in {wait:.1f} s", retry_after=wait)
    meter.limiter, meter.taken, meter.started = limiter, policy.cost, time.monotonic()


class ReadMetering:
    """ASGI layer around the app's routes: settles a read's `ReadMeter` once its route has
    answered, before the answer goes out (so the token's next read sees what this one owes),
    and in any case when the request ends."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        # reads are GETs, and POSTs whose body asks the question (a what-if)
        if scope["type"] != "http" or scope["method"] not in ("GET", "POST"):
            await self.app(scope, receive, send)
            return

        async def settled_first(message) -> None:
            if message["type"] == "http.response.start":
                meter: ReadMeter | None = scope.get(READ_METER)
                if meter is not None:
                    await meter.settle()
            await send(message)

        try:
            await self.app(scope, receive, settled_first)
        finally:
            meter: ReadMeter | None = scope.get(READ_METER)
            if meter is not None:
                await meter.settle()
