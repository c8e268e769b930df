"""Held refusals: the policy table decides which refusals wait out the refusal hold, not the
error; a route that holds refusals holds a cap's refusal, one that does not answers at once."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from controlplane.errors import CapReached, Conflict
from controlplane.guards.holds import RefusalHold, hold_refusal, route_policy
from controlplane.guards.policy import UNLISTED, policy_for


def _request(method: str, path: str, route_path: str | None = None, hold_s: float = 0.2):
    route = SimpleNamespace(path=route_path) if route_path is not None else None
    scope = {"method": method, "path": path, "root_path": ""}
    if route is not None:
        scope["route"] = route
    app = SimpleNamespace(state=SimpleNamespace(refusal_hold=RefusalHold(hold_s)))
    return SimpleNamespace(scope=scope, app=app)


def _held(request, error) -> float:
    async def timed() -> float:
        began = time.monotonic()
        await hold_refusal(request, error)
        return time.monotonic() - began

    return asyncio.run(timed())


def test_a_cap_refusal_is_held_where_the_route_holds_refusals():
    beat = _request("POST", "/v1/deployments/chat/heartbeats",
                    "/v1/deployments/{name}/heartbeats")
    assert _held(beat, CapReached("full")) >= 0.18


def test_a_route_that_holds_no_refusals_answers_at_once():
    create = _request("POST", "/v1/deployments", "/v1/deployments")
    assert _held(create, CapReached("full")) < 0.1


def test_other_refusals_are_not_held_by_the_edge():
    beat = _request("POST", "/v1/deployments/chat/heartbeats",
                    "/v1/deployments/{name}/heartbeats")
    assert _held(beat, Conflict("another")) < 0.1


def test_a_request_not_yet_routed_finds_its_policy_by_its_path():
    telemetry = _request("POST", "/v1/telemetry")
    assert route_policy(telemetry.scope) is policy_for("POST", "/v1/telemetry")
    assert _held(telemetry, CapReached("full")) >= 0.18
    assert route_policy(_request("POST", "/nowhere").scope) is UNLISTED


def test_the_hold_holds_at_most_max_held_at_once():
    hold = RefusalHold(0.2, max_held=1)

    async def two() -> list[float]:
        return list(await asyncio.gather(hold(), hold()))

    assert sorted(asyncio.run(two())) == [0.0, 0.2]
    assert asyncio.run(hold(at_most=0.05)) == 0.05
