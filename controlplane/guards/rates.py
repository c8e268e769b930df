"""A request's rate: what its route's policy costs, taken from its token's bucket of the kind
the policy names ("pull", "ingest", "heartbeat"; reads: controlplane/guards/reads.py), or 429
with Retry-After. The routes (through `RouteGuard`, controlplane/guards/route_guard.py) and the
telemetry fast path take it with these same functions, from the same shared buckets."""

from __future__ import annotations

from controlplane.auth.service import Principal
from controlplane.errors import RateLimited
from controlplane.guards.buckets import RateLimiter
from controlplane.guards.policy import RoutePolicy

# Scope key: the bucket an ASGI layer below the router already took this request's rate from
# (the telemetry fast path hands a heartbeat it cannot parse on to the route).
RATE_TAKEN = "exitplane.rate_taken"


async def check_rate(state, policy: RoutePolicy, principal: Principal) -> None:
    """Take `policy.cost` from the token's `policy.bucket`, or RateLimited with the wait, once
    the refusal has been held where the policy holds refusals (`RefusalHold`:
    EXITPLANE_RATE_LIMIT_HOLD_S)."""
    limiter: RateLimiter = state.rate_limiters[policy.bucket]
    wait = await limiter.retry_after(str(principal.token_id), policy.cost)
    if wait is not None and policy.held:
        await state.refusal_hold()
    refuse_past_rate(policy.bucket, wait)


def check_rate_blocking(state, policy: RoutePolicy, principal: Principal) -> None:
    """`check_rate` for code already on a worker thread (the same shared bucket; a refusal
    is answered without the hold, which waits on the event loop)."""
    limiter: RateLimiter = state.rate_limiters[policy.bucket]
    refuse_past_rate(policy.bucket, limiter.take(str(principal.token_id), policy.cost))


def refuse_past_rate(kind: str, wait: float | None) -> None:
    """RateLimited (429, Retry-After) when a bucket answered a wait."""
    if wait is not None:
        raise RateLimited(f"too many {kind} requests for this token; retry in {wait:.1f} s",
                          retry_after=wait)
