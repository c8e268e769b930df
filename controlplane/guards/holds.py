"""Refusals held before they are answered: a client that retries as soon as it is refused
makes a request per connection per hold, not as many as the process can refuse.

`RefusalHold` waits (EXITPLANE_RATE_LIMIT_HOLD_S for the API, EXITPLANE_SIGN_IN_HOLD_S for the
admin UI's sign-in gate). Which refusals wait is the policy table's `held`
(controlplane/guards/policy.py): a refusal past a route's bucket is held where the bucket
refuses it (controlplane/guards/rates.py, reads.py), and a refusal past a cap on the runtimes
a request registers (`CapReached`) by the edge's error handler, through `hold_refusal`.
"""

from __future__ import annotations

import asyncio

from controlplane.errors import CapReached, DomainError
from controlplane.guards.policy import UNLISTED, RoutePolicy, match, policy_for


class RefusalHold:
    """Holds a refused request on the event loop before its answer (nothing but its connection
    and a timer). At most `max_held` at once per process; past them a refusal is answered at
    once."""

    def __init__(self, hold_s: float, max_held: int = 256) -> None:
        self.hold_s, self.max_held = hold_s, max_held
        self.held = 0

    async def __call__(self, at_most: float = float("inf")) -> float:
        """Wait `hold_s` (or `at_most`, if shorter) when a place is free; the seconds held."""
        seconds = min(self.hold_s, at_most)
        if seconds <= 0 or self.held >= self.max_held:
            return 0.0
        self.held += 1
        try:
            await asyncio.sleep(seconds)
        finally:
            self.held -= 1
        return seconds


def route_policy(scope) -> RoutePolicy:
    """The policy of the request in `scope`: its route's when routed, else by its raw path
    (a fast path answering before routing)."""
    route = scope.get("route")
    if route is not None:
        return policy_for(scope["method"], getattr(route, "path", ""))
    path = scope["path"].removeprefix(scope.get("root_path", ""))
    found = match(scope["method"], path)
    return UNLISTED if found is None else found.policy


async def hold_refusal(request, error: DomainError) -> None:
    """Hold `error`'s answer when its route's policy holds refusals and it refuses a runtime
    past a cap (a client making up new runtime ids would otherwise be refused as fast as it
    asks). Refusals past a bucket were held where the bucket refused them."""
    if isinstance(error, CapReached) and route_policy(request.scope).held:
        await request.app.state.refusal_hold()
