"""The telemetry decode budget: slots and memory per process, 429 while others hold it, 413
when a batch alone needs more than all of it, and a refused batch's bytes owed by its token."""

from __future__ import annotations

import pytest

from controlplane.errors import BatchTooLarge
from controlplane.guards.buckets import LocalRateLimiter
from controlplane.guards.budgets import (
    DECODED_VALUE_BYTES,
    REFUSED_BYTES_PER_UNIT,
    SMALL_BODY_BYTES,
    DecodeBudget,
    DecodersBusy,
)


def _budget(slots: int = 2, size: int = 1 << 20, ingest=None) -> DecodeBudget:
    return DecodeBudget(slots=slots, size_bytes=size, max_body_bytes=size // 4, ingest=ingest)


def test_a_small_body_needs_no_charge():
    budget = _budget()
    with budget.held(str(SMALL_BODY_BYTES)) as charge:
        assert charge is None
    assert budget.used == 0


def test_a_large_body_is_charged_twice_its_bytes_and_given_back():
    budget = _budget()
    with budget.held(str(100_000)) as charge:
        assert budget.used == charge.held == 200_000
        charge.values(10)  # a step of values at once
        assert budget.used > 200_000
    assert budget.used == 0


def test_a_body_of_unknown_length_is_charged_the_byte_limit():
    budget = _budget()
    with budget.held(None):
        assert budget.used == 2 * budget.max_body_bytes


def test_past_the_slots_a_request_is_refused_at_once():
    budget = _budget(slots=1)
    with budget.held("100000"), pytest.raises(DecodersBusy) as refused, budget.held("100000"):
        pass
    assert refused.value.status_code == 429 and refused.value.retry_after == 1.0
    assert "EXITPLANE_TELEMETRY_MAX_DECODES" in str(refused.value)


def test_values_past_the_budget_are_refused_429_then_413():
    budget = _budget(size=1 << 20)
    # The second would fit alone, but the first holds part of the budget: retry.
    with budget.held("100000"), budget.held("100000") as second, \
            pytest.raises(DecodersBusy):
        second.values(700_000 // DECODED_VALUE_BYTES)
    with budget.held("100000") as alone, pytest.raises(BatchTooLarge) as too_large:
        alone.values(2 * (1 << 20) // DECODED_VALUE_BYTES)
    assert too_large.value.status_code == 413


def test_a_refused_batch_costs_its_token_ingest_units():
    ingest = LocalRateLimiter(1.0)  # a burst of 2
    budget = _budget(ingest=ingest)
    budget.charge_refused("7", 3 * REFUSED_BYTES_PER_UNIT)
    assert ingest.take("7") is not None  # 2 - 3 units: in debt
    assert ingest.take("8") is None  # another token is not
