"""What each token record says it cost: the exit checks computed for it and its share of the
step's wall time (tiny random Llama, exit layers 2 and 4 of 6)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from exitplane.wire import Signal
from runtime import step as step_module
from runtime.engine import Engine, EngineConfig, ExitPolicy
from runtime.model import tiny_llama
from runtime.step import StepClock

PROMPTS = [[1, 5, 9, 33, 7], [1, 17, 3], [1, 40, 41, 42, 43, 44, 45], [1]]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_llama(seed=0)


def run(model, policy: ExitPolicy | None = None, *, batch: int = 4, shadow_rate: float = 0.0,
        segments: list[str] | None = None):
    engine = Engine(model, exit_layers=[2, 4], config=EngineConfig(
        max_batch=batch, max_seq_len=64, shadow_rate=shadow_rate, seed=1))
    if policy is not None:
        engine.set_thresholds(policy)
    for prompt, segment in zip(PROMPTS, segments or [None] * len(PROMPTS), strict=True):
        engine.add_request(prompt, max_new_tokens=6, stop_token_ids=[], segment=segment)
    while engine.has_work:
        engine.step()
    return engine.drain_records()


def policy(thresholds: dict[int, float], **segments: dict[int, float]) -> ExitPolicy:
    return ExitPolicy(version=1, signal=Signal.maxprob, thresholds=thresholds,
                      segments=segments)


def test_shadow_tokens_compute_every_exit_point(model):
    records = run(model, shadow_rate=1.0)
    assert records and all(r.shadow is not None for r in records)
    assert {r.exit_checks for r in records} == {2}
    assert {r.exit_layer for r in records} == {6}


def test_a_never_exit_set_computes_no_checks(model):
    records = run(model)
    assert {r.exit_checks for r in records} == {0}
    assert {r.exit_layer for r in records} == {6}


@pytest.mark.parametrize(("thresholds", "exit_layer", "checks"), [
    ({2: 0.0, 4: 1.0}, 2, 1),  # leaves at the first check
    ({2: 1.0, 4: 0.0}, 4, 1),  # layer 2 can never pass (1.0): skipped, not computed
    ({2: 1.0 - 1e-7, 4: 0.0}, 4, 2),  # layer 2 computed and failed, layer 4 taken
])
def test_an_exit_at_layer_k_counts_the_checks_run_up_to_k(model, thresholds, exit_layer,
                                                          checks):
    records = run(model, policy(thresholds))
    assert {r.exit_layer for r in records} == {exit_layer}
    assert {r.exit_checks for r in records} == {checks}


def test_a_token_is_charged_for_the_checks_its_batch_computed_on_it(model):
    # A `default` token (never exit) shares its steps with `fast` tokens that leave at 2: the
    # check at layer 2 ran on the whole batch, the `default` token included.
    records = run(model, policy({2: 1.0, 4: 1.0}, fast={2: 0.0, 4: 1.0}),
                  segments=["fast", "default", "fast", "default"])
    fast = [r for r in records if r.segment == "fast"]
    deep = [r for r in records if r.segment == "default"]
    assert {(r.exit_layer, r.exit_checks) for r in fast} == {(2, 1)}
    assert {(r.exit_layer, r.exit_checks) for r in deep} == {(6, 1)}
    # alone, the same never-exit tokens compute none
    alone = run(model, policy({2: 1.0, 4: 1.0}, fast={2: 0.0, 4: 1.0}))
    assert {r.exit_checks for r in alone} == {0}


def test_step_clock_charges_each_stretch_to_the_rows_that_ran_it(monkeypatch):
    ticks = iter([0.0, 3.0, 5.0, 6.5])
    monkeypatch.setattr(step_module, "perf_counter", lambda: next(ticks))
    clock = StepClock(3)
    clock.lap(np.array([0, 1, 2]))  # 3 s shared by all three rows
    clock.lap(np.array([1, 2]))  # 2 s: row 0 had left
    latency = clock.latency_us()  # 1.5 s of shared tail
    assert latency == [1_500_000, 2_500_000, 2_500_000]
    assert sum(latency) == 6_500_000  # the shares add up to the step


def test_records_carry_their_share_of_the_step(model, monkeypatch):
    # One clock tick per reading: the step starts at 0, the fast row leaves at layer 2 (1),
    # the deep row finishes its layers (2), the tail ends (3).
    ticks = itertools.count()
    monkeypatch.setattr(step_module, "perf_counter", lambda: float(next(ticks)))
    engine = Engine(model, exit_layers=[2, 4], config=EngineConfig(max_batch=2, max_seq_len=64))
    engine.set_thresholds(policy({2: 1.0, 4: 1.0}, fast={2: 0.0, 4: 1.0}))
    engine.add_request(PROMPTS[0], max_new_tokens=1, stop_token_ids=[], segment="fast")
    engine.add_request(PROMPTS[1], max_new_tokens=1, stop_token_ids=[])
    outputs = engine.step()
    by_segment = {out.record.segment: out.record for out in outputs}
    assert by_segment["fast"].latency_us == 1_000_000  # 0.5 s of layers 1-2, 0.5 s of tail
    assert by_segment["default"].latency_us == 2_000_000  # + 1 s of layers 3-6 alone
