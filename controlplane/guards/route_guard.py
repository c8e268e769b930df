"""The guards on the API's routes, driven by the policy table (controlplane/guards/policy.py):
`install_guards` sets up what they share on the app (rate limiters, the refusal hold, the
heavy-read turns, the telemetry decode budget, the read metering layer), and `RouteGuard`,
the one dependency the edge gives every router, takes each request's rate before its route
runs. Routes never declare a limit themselves."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, FastAPI, Request

from controlplane.auth.deps import get_principal
from controlplane.auth.service import Principal
from controlplane.guards.buckets import make_rate_limiters
from controlplane.guards.budgets import DecodeBudget
from controlplane.guards.holds import RefusalHold
from controlplane.guards.policy import policy_for
from controlplane.guards.rates import RATE_TAKEN, check_rate
from controlplane.guards.reads import (
    HEAVY_READS_AT_ONCE,
    HEAVY_READS_WAITING,
    ReadMetering,
    Turns,
    take_read,
)


def install_guards(app: FastAPI, settings) -> None:
    """Give `app` what its guards share: one rate limiter per bucket (shared through Redis
    when `settings.redis_url`, else in process), the refusal hold, the heavy-read turns, the
    telemetry decode budget, and the layer that settles metered reads."""
    state = app.state
    state.rate_limiters = make_rate_limiters(redis_url=settings.redis_url, rates={
        "pull": settings.rate_limit_pull_per_s, "ingest": settings.rate_limit_ingest_per_s,
        "heartbeat": settings.rate_limit_heartbeat_per_s, "read": settings.rate_limit_read_per_s})
    state.refusal_hold = RefusalHold(settings.rate_limit_hold_s)
    state.heavy_read_turns = Turns(HEAVY_READS_AT_ONCE, HEAVY_READS_WAITING)
    state.telemetry_decodes = DecodeBudget.from_settings(
        settings, ingest=state.rate_limiters["ingest"])
    app.add_middleware(ReadMetering)


async def guard_route(request: Request,
                      principal: Annotated[Principal, Depends(get_principal)]) -> None:
    """Take the request's rate from the bucket its route's policy names (429 past it), before
    the route's own dependencies run. Every route of the API's routers needs a token: the
    caller is resolved first (401), once for the guard and the route's scope check."""
    policy = policy_for(request.method, getattr(request.scope.get("route"), "path", ""))
    if policy.bucket == "read":
        await take_read(request, policy, principal)
    elif policy.bucket is not None and request.scope.get(RATE_TAKEN) != policy.bucket:
        await check_rate(request.app.state, policy, principal)


# For the API's routers: `include_router(router, dependencies=[RouteGuard])`.
RouteGuard = Depends(guard_route)
