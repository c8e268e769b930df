"""Per-segment thresholds in one batch: each row applies its own segment's map, its
records carry the segment, and a batch of default rows carries no segment field."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from exitplane.wire import Signal, ThresholdSetWire
from runtime.engine import Engine, EngineConfig, ExitPolicy
from runtime.model import tiny_llama
from runtime.policy import RowPlan, SegmentRows

PROMPTS = [[1, 5, 9, 33, 7], [1, 17, 3], [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49], [1]]
NEW_TOKENS = 8
NUM_LAYERS = 6
# default never exits; code leaves every token at layer 2 (any signal > 0), chat at layer 4
SEGMENTED = ThresholdSetWire.build(deployment="tiny", version=3, signal="maxprob",
                                   thresholds={2: 1.0, 4: 1.0},
                                   segments={"code": {2: 0.0, 4: 1.0}, "chat": {2: 1.0, 4: 0.0}})


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


def engine(model, **config) -> Engine:
    config.setdefault("max_seq_len", 64)
    return Engine(model, exit_layers=[2, 4], config=EngineConfig(**config))


def run(eng: Engine, prompts, segments) -> tuple[list[list[int]], dict[str, list]]:
    """Decode prompts together, each with its segment; (tokens, records) per request."""
    ids = [eng.add_request(p, max_new_tokens=NEW_TOKENS, stop_token_ids=[], segment=s)
           for p, s in zip(prompts, segments, strict=True)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while eng.has_work:
        for item in eng.step():
            tokens[item.request_id].append(item.token)
    records: dict[str, list] = {i: [] for i in ids}
    for record in eng.drain_records():
        records[record.request_id].append(record)
    return [tokens[i] for i in ids], [records[i] for i in ids]


def alone(model, wire_or_policy, prompt, segment, **config) -> list[int]:
    eng = engine(model, max_batch=1, **config)
    eng.set_thresholds(wire_or_policy)
    return run(eng, [prompt], [segment])[0][0]


@pytest.mark.parametrize("batching", ["compact", "mask"])
def test_rows_of_one_batch_exit_at_their_own_segment_s_layer(model, batching):
    eng = engine(model, max_batch=4, batching=batching)
    eng.set_thresholds(SEGMENTED)
    segments = ["code", None, "chat", "ops"]  # None: no segment; ops: a set without its map
    tokens, records = run(eng, PROMPTS, segments)
    exits = [{r.exit_layer for r in rows} for rows in records]
    assert exits == [{2}, {NUM_LAYERS}, {4}, {NUM_LAYERS}]
    assert [{r.segment for r in rows} for rows in records] == [
        {"code"}, {"default"}, {"chat"}, {"ops"}]
    assert all(r.threshold_version == 3 for rows in records for r in rows)
    # a never-exit row's tokens have no signal, though its batch checked both exit layers
    assert {r.signal_value for r in records[1] + records[3]} == {None}
    assert all(r.signal_value is not None for r in records[0] + records[2])
    # each row decodes what it decodes alone under its own map
    for prompt, segment, got in zip(PROMPTS, segments, tokens, strict=True):
        assert got == alone(model, SEGMENTED, prompt, segment)


def test_a_segment_s_map_decides_its_own_rows_against_a_live_default(model):
    # default exits everything at 2; code never exits: the code row runs to full depth and
    # matches the model's greedy output while its neighbour leaves early.
    wire = ThresholdSetWire.build(deployment="tiny", version=4, signal="maxprob",
                                  thresholds={2: 0.0, 4: 0.0},
                                  segments={"code": {2: 1.0, 4: 1.0}})
    eng = engine(model, max_batch=2)
    eng.set_thresholds(wire)
    tokens, records = run(eng, PROMPTS[:2], ["default", "code"])
    assert {r.exit_layer for r in records[0]} == {2}
    assert {r.exit_layer for r in records[1]} == {NUM_LAYERS}
    reference = model.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=NEW_TOKENS,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
    assert tokens[1] == reference[0, len(PROMPTS[1]):].tolist()


def test_an_all_default_batch_decodes_as_a_set_without_segments(model):
    plain = ExitPolicy(version=2, signal=Signal.maxprob, thresholds={2: 0.12, 4: 0.1})
    segmented = ExitPolicy(version=2, signal=Signal.maxprob, thresholds={2: 0.12, 4: 0.1},
                           segments={"code": {2: 1.0, 4: 1.0}})
    results = []
    for policy in (plain, segmented):
        eng = engine(model, max_batch=4, shadow_rate=0.3, seed=7)
        eng.set_thresholds(policy)
        tokens, records = run(eng, PROMPTS, [None] * len(PROMPTS))
        results.append((tokens, [[(r.exit_layer, r.signal_value, r.shadow) for r in rows]
                                 for rows in records]))
    assert results[0] == results[1]
    assert len({layer for rows in results[0][1] for layer, _, _ in rows}) >= 2  # ragged


def test_a_set_whose_segment_names_an_unknown_layer_is_refused(model):
    eng = engine(model)
    wire = ThresholdSetWire.build(deployment="tiny", version=5, signal="maxprob",
                                  thresholds={2: 0.5, 4: 0.5}, segments={"code": {3: 0.5}})
    with pytest.raises(ValueError, match=r"exit layers \[3\] \(segment 'code'\)"):
        eng.set_thresholds(wire)
    assert eng.policy.version == 0


def test_a_malformed_segment_is_refused_at_add_request(model):
    eng = engine(model)
    with pytest.raises(ValueError, match="segment 'Code!' must match"):
        eng.add_request([1, 2], segment="Code!")
    assert not eng.has_work


def test_row_plan_gives_each_row_its_map_and_counts_only_its_own_checks():
    policy = ExitPolicy.from_wire(SEGMENTED, [2, 4])
    plan = RowPlan.build(policy, ["code", "default", "chat", "default"],
                         [False, False, False, True])
    assert plan.layers == (2, 4)
    assert plan.limits.tolist() == [[0.0, 1.0], [1.0, 1.0], [1.0, 0.0], [1.0, 1.0]]
    # code counts its layer-2 check, chat its layer-4 one; a never-exit row counts nothing
    # unless it is a shadow row (then every check, as for a set without segments)
    assert plan.counted.tolist() == [[True, False], [False, False], [False, True],
                                     [True, True]]
    assert policy.checked_layers(shadow=False, segments=["default"]) == frozenset()
    assert policy.checked_layers(shadow=False, segments=["default", "chat"]) == {4}


def test_saturation_serves_a_segment_s_whole_chain_up_to_its_deepest_live_layer():
    policy = ExitPolicy(version=1, signal=Signal.saturation, thresholds={2: 1.0, 4: 1.0},
                        segments={"code": {2: 1.0, 4: 0.4}})
    assert policy.served_layers("code") == {2, 4}  # layer 2 feeds layer 4's agreement run
    assert policy.served_layers("default") == frozenset()
    plan = RowPlan.build(policy, ["code", "default"], [False, False])
    assert plan.counted.tolist() == [[True, True], [False, False]]


def test_a_policy_derives_its_segment_rows_once_not_at_every_step(model, monkeypatch):
    derived: list[int] = []
    lookups: list[str | None] = []
    derive, for_segment = SegmentRows.derive.__func__, ExitPolicy.for_segment

    def counting_derive(cls, policy):
        derived.append(policy.version)
        return derive(cls, policy)

    def counting_for_segment(policy, segment):
        lookups.append(segment)
        return for_segment(policy, segment)

    monkeypatch.setattr(SegmentRows, "derive", classmethod(counting_derive))
    monkeypatch.setattr(ExitPolicy, "for_segment", counting_for_segment)
    eng = engine(model, max_batch=4)
    eng.set_thresholds(SEGMENTED)
    steps = 0
    for prompt, segment in zip(PROMPTS, ["code", None, "chat", "ops"], strict=True):
        eng.add_request(prompt, max_new_tokens=NEW_TOKENS, stop_token_ids=[], segment=segment)
    while eng.has_work:
        eng.step()
        steps += 1
    assert steps >= NEW_TOKENS
    eng.drain_records()
    # the engine's never-exit policy and the applied set, each once; no step looks a map up
    assert derived == [0, 3] and lookups == []
    # a new set brings its own rows, and the next steps apply them: code never exits now
    swapped = ThresholdSetWire.build(deployment="tiny", version=4, signal="maxprob",
                                     thresholds={2: 1.0, 4: 1.0},
                                     segments={"code": {2: 1.0, 4: 1.0}, "chat": {2: 0.0}})
    eng.set_thresholds(swapped)
    _, records = run(eng, PROMPTS[:2], ["code", "chat"])
    assert derived == [0, 3, 4] and lookups == []
    assert [{r.exit_layer for r in rows} for rows in records] == [{NUM_LAYERS}, {2}]
    plan = RowPlan.build(eng.policy, ["chat"], [False])
    kept = eng.policy.segment_rows
    assert plan.column is kept.column and not kept.limits.flags.writeable  # shared, read-only


def _plan_row_by_row(policy: ExitPolicy, segments, shadow) -> tuple[list, list]:
    """What a step's plan must hold, derived from the maps for each row on its own."""
    limits, counted = [], []
    for segment, row_shadow in zip(segments, shadow, strict=True):
        by_layer, served = policy.for_segment(segment), policy.served_layers(segment)
        limits.append([np.float32(by_layer.get(k, 1.0)) for k in policy.layers])
        counted.append([k in served if served else row_shadow for k in policy.layers])
    return limits, counted


@pytest.mark.parametrize("signal", [Signal.maxprob, Signal.saturation])
def test_the_gathered_plan_equals_each_row_s_own_map(signal):
    rng = random.Random(18)
    for _ in range(50):
        def a_map():
            return {k: rng.choice([0.0, 0.3, 0.7, 1.0]) for k in rng.sample([2, 4, 6], 2)}

        policy = ExitPolicy(version=1, signal=signal, thresholds=a_map(),
                            segments={name: a_map() for name in rng.sample(["chat", "code"],
                                                                            rng.randint(0, 2))})
        segments = [rng.choice(["chat", "code", "ops", "default", None]) for _ in range(6)]
        shadow = [rng.random() < 0.3 for _ in segments]
        plan = RowPlan.build(policy, segments, shadow)
        limits, counted = _plan_row_by_row(policy, segments, shadow)
        assert plan.limits.dtype == np.float32 and plan.limits.tolist() == limits
        assert plan.counted.tolist() == counted
