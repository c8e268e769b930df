"""Engine invariants on a tiny random Llama: HF equivalence, KV completeness, swaps, shadows."""

from __future__ import annotations

import pytest
import torch

from exitplane.wire import Signal, ThresholdSetWire, TokenRecord
from runtime.engine import Engine, EngineConfig, ExitPolicy
from runtime.heads import ExitHeads
from runtime.model import decoder_parts, tiny_llama
from tests.support.generation import greedy_full_depth

PROMPTS = [[1, 5, 9, 33, 7], [1, 17, 3], [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49], [1]]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def reference(model):
    return greedy_full_depth(model, PROMPTS, NEW_TOKENS)


def engine(model, **config) -> Engine:
    config.setdefault("max_seq_len", 64)
    return Engine(model, exit_layers=[2, 4], config=EngineConfig(**config))


def exit_all_at(layer: int, version: int = 1) -> ExitPolicy:
    """Every non-shadow token leaves at `layer` (any signal > 0)."""
    return ExitPolicy(version=version, signal=Signal.maxprob,
                      thresholds={2: 0.0 if layer == 2 else 1.0, 4: 0.0 if layer == 4 else 1.0})


@pytest.mark.slow
@pytest.mark.parametrize("kv_policy", ["lazy", "propagate"])
@pytest.mark.parametrize("batching", ["compact", "mask"])
@pytest.mark.parametrize("max_batch", [1, 4])
def test_never_exit_matches_hf_generate(model, reference, kv_policy, batching, max_batch):
    eng = engine(model, kv_policy=kv_policy, batching=batching, max_batch=max_batch)
    got = eng.generate(PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=[])
    assert got == reference
    records = eng.drain_records()
    assert len(records) == len(PROMPTS) * NEW_TOKENS
    assert {r.exit_layer for r in records} == {6}
    assert {r.threshold_version for r in records} == {0}


def hf_cache(model, tokens: list[int]):
    """(keys, values) per layer of the full model over `tokens`: (Hkv, T, D) each."""
    out = model(torch.tensor([tokens]), use_cache=True)
    cache = out.past_key_values
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


def fed_tokens(prompt: list[int], generated: list[int]) -> list[int]:
    """Tokens whose KV the engine has written: the prompt and all but the last generated."""
    return prompt + generated[:-1]


def test_lazy_fills_skipped_layers_exactly_once_a_deep_token_comes(model):
    eng = engine(model, kv_policy="lazy", max_batch=2)
    parts = decoder_parts(model)
    prompt = PROMPTS[0]
    rid = eng.add_request(prompt, max_new_tokens=12, stop_token_ids=[])
    eng.step()  # full depth
    eng.set_thresholds(exit_all_at(2))
    for _ in range(4):
        outputs = eng.step()
        assert outputs[0].record.exit_layer == 2
    slot = eng._running[rid].slot
    generated = eng._running[rid].generated
    length = len(prompt) + len(generated) - 1
    # exited positions have KV only for layers 1..2; deeper layers wait (pending)
    assert list(eng.cache.filled[slot][:2]) == [length, length]
    assert all(f == length - 4 for f in eng.cache.filled[slot][2:])
    assert not eng.cache.complete(slot, length)

    eng.set_thresholds(ExitPolicy.never_exit([2, 4], Signal.maxprob))
    outputs = eng.step()
    assert outputs[0].record.exit_layer == parts.num_layers
    generated = eng._running[rid].generated
    tokens = fed_tokens(prompt, generated)
    assert eng.cache.complete(slot, len(tokens))
    expected = hf_cache(model, tokens)
    for layer, (keys, values) in enumerate(expected):
        got_k = eng.cache.keys[layer, slot, :, : len(tokens)]
        got_v = eng.cache.values[layer, slot, :, : len(tokens)]
        torch.testing.assert_close(got_k, keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got_v, values, rtol=1e-4, atol=1e-5)


def test_propagate_fills_every_layer_at_exit(model):
    eng = engine(model, kv_policy="propagate", max_batch=1)
    prompt = PROMPTS[1]
    rid = eng.add_request(prompt, max_new_tokens=8, stop_token_ids=[])
    eng.set_thresholds(exit_all_at(4))
    for _ in range(3):
        assert eng.step()[0].record.exit_layer == 4
    request = eng._running[rid]
    tokens = fed_tokens(prompt, request.generated)
    assert eng.cache.complete(request.slot, len(tokens))
    expected = hf_cache(model, tokens)
    # layers the tokens ran are exact; skipped layers hold the projected (approximate) KV
    for layer in range(4):
        torch.testing.assert_close(eng.cache.keys[layer, request.slot, :, : len(tokens)],
                                   expected[layer][0], rtol=1e-4, atol=1e-5)
    for layer in (4, 5):
        got = eng.cache.keys[layer, request.slot, :, : len(tokens)]
        assert got[:, len(prompt) - 1:].abs().sum(-1).min() > 0
        torch.testing.assert_close(got[:, : len(prompt) - 1],
                                   expected[layer][0][:, : len(prompt) - 1], rtol=1e-4, atol=1e-5)


def test_compaction_and_mask_only_agree_under_exits(model):
    policy = ExitPolicy(version=2, signal=Signal.maxprob, thresholds={2: 0.12, 4: 0.1})
    results = {}
    for batching in ("compact", "mask"):
        eng = engine(model, batching=batching, max_batch=4)
        eng.set_thresholds(policy)
        results[batching] = eng.generate(PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=[])
        layers = [r.exit_layer for r in eng.drain_records()]
        assert {2, 4, 6} <= set(layers), "thresholds should produce ragged exits"
    assert results["compact"] == results["mask"]


def test_threshold_swap_during_generation(model):
    eng = engine(model, max_batch=2)
    rid = eng.add_request(PROMPTS[0], max_new_tokens=10, stop_token_ids=[])
    before = [eng.step()[0].record for _ in range(3)]
    wire = ThresholdSetWire.build(deployment="tiny", version=7, signal="maxprob",
                                  thresholds={2: 0.0, 4: 1.0})
    eng.set_thresholds(wire)
    after = [eng.step()[0].record for _ in range(3)]
    assert [r.threshold_version for r in before] == [0, 0, 0]
    assert [r.exit_layer for r in before] == [6, 6, 6]
    assert [r.threshold_version for r in after] == [7, 7, 7]
    assert [r.exit_layer for r in after] == [2, 2, 2]
    assert all(r.request_id == rid for r in before + after)
    assert [r.position for r in before + after] == list(range(6))


def test_threshold_set_for_unknown_layer_is_refused(model):
    eng = engine(model)
    wire = ThresholdSetWire.build(deployment="tiny", version=1, signal="maxprob",
                                  thresholds={3: 0.5})
    with pytest.raises(ValueError, match="exit layers"):
        eng.set_thresholds(wire)


def logit_lens(model, tokens: list[int]):
    """Per-position hidden states after each layer and the model's final top-1."""
    out = model(torch.tensor([tokens]), output_hidden_states=True)
    return out.hidden_states, out.logits[0].argmax(-1)


def test_shadow_records_label_every_exit_point(model):
    parts = decoder_parts(model)
    eng = engine(model, max_batch=1, shadow_rate=1.0)
    eng.set_thresholds(exit_all_at(2, version=4))  # would exit everything, but shadows don't
    prompt = PROMPTS[2]
    generated = eng.generate([prompt], max_new_tokens=6, stop_token_ids=[])[0]
    records = eng.drain_records()
    tokens = fed_tokens(prompt, generated)
    hidden, final_top1 = logit_lens(model, tokens)
    for record in records:
        assert record.exit_layer == parts.num_layers
        assert record.shadow is not None
        assert [p.layer for p in record.shadow] == [2, 4]
        position = len(prompt) - 1 + record.position
        assert final_top1[position].item() == generated[record.position]
        for point in record.shadow:
            logits = parts.lm_head(parts.norm(hidden[point.layer][0, position]))
            probs = torch.softmax(logits, -1)
            assert point.signal == pytest.approx(probs.max().item(), abs=1e-4)
            assert point.matched == (logits.argmax().item() == generated[record.position])


def test_shadow_rate_zero_records_no_shadow(model):
    eng = engine(model, max_batch=2)
    eng.generate(PROMPTS[:2], max_new_tokens=4, stop_token_ids=[])
    assert all(r.shadow is None for r in eng.drain_records())


@pytest.mark.slow
def test_continuous_batching_join_leave_cancel(model, reference):
    seen = []
    eng = Engine(model, exit_layers=[2, 4], config=EngineConfig(max_batch=2, max_seq_len=64),
                 on_record=seen.append)
    a = eng.add_request(PROMPTS[0], max_new_tokens=NEW_TOKENS, stop_token_ids=[])
    out: dict[str, list[int]] = {a: []}
    for _ in range(3):
        for item in eng.step():
            out[item.request_id].append(item.token)
    b = eng.add_request(PROMPTS[2], max_new_tokens=NEW_TOKENS, stop_token_ids=[])
    c = eng.add_request(PROMPTS[1], max_new_tokens=NEW_TOKENS, stop_token_ids=[])
    out[b], out[c] = [], []
    step = 0
    while eng.has_work:
        items = eng.step()
        assert len(items) <= 2
        for item in items:
            out[item.request_id].append(item.token)
        step += 1
        if step == 5:
            assert eng.cancel(b)
    assert out[a] == reference[0]
    assert out[c] == reference[1]
    assert out[b] == reference[2][: len(out[b])] and 0 < len(out[b]) < NEW_TOKENS
    assert len(seen) == sum(len(v) for v in out.values())
    assert not eng.cancel("missing")


def test_stop_token_finishes_request(model, reference):
    eng = engine(model, max_batch=1)
    stop = reference[0][3]
    got = eng.generate([PROMPTS[0]], max_new_tokens=NEW_TOKENS, stop_token_ids=[stop])[0]
    assert got == reference[0][: reference[0].index(stop) + 1]


def test_learned_signal_exits_without_logits_until_taken(model):
    parts = decoder_parts(model)
    heads = ExitHeads(exit_layers=[2, 4], hidden_size=parts.hidden_size, eps=1e-5,
                      norm_weight=parts.norm.weight)
    with torch.no_grad():
        heads.confidence["2"].fc2.bias.fill_(5.0)  # confident at layer 2
        heads.confidence["4"].fc2.bias.fill_(-5.0)
    eng = Engine(model, heads=heads, config=EngineConfig(max_batch=4, max_seq_len=64))
    eng.set_thresholds(ExitPolicy(version=1, signal=Signal.learned, thresholds={2: 0.5, 4: 0.5}))
    eng.generate(PROMPTS, max_new_tokens=4, stop_token_ids=[])
    records = eng.drain_records()
    assert {r.exit_layer for r in records} == {2}
    assert all(r.signal_value > 0.5 for r in records)


def test_learned_signal_requires_heads(model):
    eng = engine(model)
    with pytest.raises(ValueError, match="heads"):
        eng.set_thresholds(ExitPolicy.never_exit([2, 4], Signal.learned))


def test_unchecked_tokens_record_no_signal_whatever_shares_their_step(model):
    # Under a never-exit set the engine skips the exit checks unless a shadow row needs them:
    # a served token then has no signal (None), not 0, and not a value that depends on whether
    # a shadow row happened to share its step.
    eng = engine(model, max_batch=4, shadow_rate=0.5, seed=3)
    eng.generate(PROMPTS, max_new_tokens=8, stop_token_ids=[])
    records = eng.drain_records()
    shadow = [r for r in records if r.shadow is not None]
    served = [r for r in records if r.shadow is None]
    assert shadow and served
    assert all(r.signal_value is None for r in served)
    assert all(r.signal_value == pytest.approx(r.shadow[-1].signal, abs=1e-6) for r in shadow)
    # A live layer is checked for every row: every token has its signal from the live checks.
    eng = engine(model, max_batch=4, shadow_rate=0.5, seed=3)
    eng.set_thresholds(ExitPolicy(version=2, signal=Signal.maxprob, thresholds={2: 0.99, 4: 1.0}))
    eng.generate(PROMPTS, max_new_tokens=8, stop_token_ids=[])
    records = eng.drain_records()
    assert all(r.signal_value is not None for r in records)
    for record in (r for r in records if r.shadow is not None):
        # the recorded signal is layer 2's (the live check), not layer 4's (a shadow label)
        assert record.signal_value == pytest.approx(record.shadow[0].signal, abs=1e-6)


def test_default_request_ids_differ_across_engines_and_fit_the_wire(model):
    """Default request ids never repeat across engines (a restarted runtime keeps its runtime
    id, and the control plane never assembles a completed request id again), and they fit the
    wire's request_id."""
    first, second = engine(model), engine(model)
    ids = [eng.add_request(PROMPTS[1], max_new_tokens=1) for eng in (first, second, first)]
    assert len(set(ids)) == 3
    for request_id in ids:
        TokenRecord(threshold_version=0, request_id=request_id, position=0, exit_layer=4,
                    signal_value=0.5, latency_us=1, ts=1.0)
        assert len(request_id) <= 32
