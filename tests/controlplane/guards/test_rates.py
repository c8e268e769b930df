"""Rates by the policy table: a request takes its route's cost from the bucket its policy
names; past it, 429 with the wait, held first where the policy holds refusals."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import pytest

from controlplane.auth.service import Principal
from controlplane.errors import RateLimited
from controlplane.guards.buckets import LocalRateLimiter
from controlplane.guards.policy import policy_for
from controlplane.guards.rates import check_rate, check_rate_blocking

BEAT = policy_for("POST", "/v1/deployments/{name}/heartbeats")
RUNTIME = Principal(token_id=7, name="fleet", scope="runtime", deployment_id=1)


class _Hold:
    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self) -> float:
        self.calls += 1
        return 0.0


def _state(rate: float = 0.5):
    return SimpleNamespace(rate_limiters={"heartbeat": LocalRateLimiter(rate)},
                           refusal_hold=_Hold())


def test_past_its_bucket_a_request_is_refused_after_the_hold():
    state = _state()  # a burst of one
    asyncio.run(check_rate(state, BEAT, RUNTIME))
    with pytest.raises(RateLimited) as refused:
        asyncio.run(check_rate(state, BEAT, RUNTIME))
    assert refused.value.status_code == 429 and refused.value.retry_after > 1
    assert str(refused.value).startswith("too many heartbeat requests for this token; retry")
    assert state.refusal_hold.calls == 1


def test_a_policy_that_holds_no_refusals_answers_at_once():
    state = _state()
    unheld = replace(BEAT, held=False)
    asyncio.run(check_rate(state, unheld, RUNTIME))
    with pytest.raises(RateLimited):
        asyncio.run(check_rate(state, unheld, RUNTIME))
    assert state.refusal_hold.calls == 0


def test_the_blocking_check_takes_from_the_same_bucket():
    state = _state()
    check_rate_blocking(state, BEAT, RUNTIME)
    with pytest.raises(RateLimited):
        asyncio.run(check_rate(state, BEAT, RUNTIME))
    other = replace(RUNTIME, token_id=8)
    check_rate_blocking(state, BEAT, other)  # each token its own bucket
