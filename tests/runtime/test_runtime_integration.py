"""The real SmolLM2-135M-Instruct end to end: HF equivalence and heads on a small budget."""

from __future__ import annotations

import pytest
import torch

from exitplane.wire import Signal
from runtime import corpus
from runtime.engine import Engine, EngineConfig, ExitPolicy
from runtime.heads import ExitHeads
from runtime.model import load_model
from runtime.train import TrainConfig, train_heads
from tests.support.generation import greedy_full_depth

# slow: the real SmolLM2 model
pytestmark = [pytest.mark.slow, pytest.mark.integration]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def smollm2():
    torch.set_num_threads(2)
    return load_model()


@pytest.fixture(scope="module")
def prompts(smollm2):
    _, tokenizer = smollm2
    return [corpus.chat_prompt_ids(tokenizer, p) for p in
            ("What is 2 + 2?", "Write a Python function that returns the largest of a list.")]


@pytest.fixture(scope="module")
def reference(smollm2, prompts):
    model, _ = smollm2
    return greedy_full_depth(model, prompts, NEW_TOKENS)


@pytest.mark.parametrize("kv_policy", ["lazy", "propagate"])
def test_real_model_never_exit_is_hf_greedy(smollm2, prompts, reference, kv_policy):
    model, _ = smollm2
    engine = Engine(model, config=EngineConfig(max_batch=2, max_seq_len=256,
                                               kv_policy=kv_policy))
    assert engine.parts.num_layers == 30
    assert engine.exit_layers == [12, 15, 18, 21, 24, 27]
    got = engine.generate(prompts, max_new_tokens=NEW_TOKENS, stop_token_ids=[])
    assert got == reference


def test_real_model_heads_small_budget(smollm2, prompts, tmp_path, monkeypatch):
    monkeypatch.setenv("EXITPLANE_CACHE_DIR", str(tmp_path))
    model, tokenizer = smollm2
    config = TrainConfig(generation_prompts=3, generation_tokens=16, stdlib_chars=8_000,
                         adapter_steps=10, batch_tokens=256, label_tokens=1500,
                         confidence_epochs=4, time_budget_s=150, model_name="smollm2-test")
    heads = train_heads(model, tokenizer, config)
    path = tmp_path / "heads.safetensors"
    heads.save(path)
    heads = ExitHeads.load(path)
    held = heads.metadata["heldout"]
    assert set(held) == {str(k) for k in heads.exit_layers}
    first, last = str(heads.exit_layers[0]), str(heads.exit_layers[-1])
    assert held[last]["agreement"] > held[first]["agreement"]

    engine = Engine(model, heads=heads, config=EngineConfig(max_batch=2, max_seq_len=256,
                                                            shadow_rate=1.0))
    engine.set_thresholds(ExitPolicy(version=1, signal=Signal.learned,
                                     thresholds=dict.fromkeys(heads.exit_layers, 0.5)))
    shadowed = engine.generate(prompts[:1], max_new_tokens=8, stop_token_ids=[])[0]
    records = engine.drain_records()
    assert all(r.exit_layer == 30 and [p.layer for p in r.shadow] == heads.exit_layers
               for r in records)
    assert any(p.matched for r in records for p in r.shadow)
    # the full-depth tokens of shadow rows are the model's greedy tokens
    assert shadowed == Engine(model).generate(prompts[:1], max_new_tokens=8,
                                              stop_token_ids=[])[0]

    engine = Engine(model, heads=heads, config=EngineConfig(max_batch=2, max_seq_len=256))
    engine.set_thresholds(ExitPolicy(version=2, signal=Signal.learned,
                                     thresholds=dict.fromkeys(heads.exit_layers, 0.0)))
    engine.generate(prompts, max_new_tokens=6, stop_token_ids=[])
    records = engine.drain_records()
    assert {r.exit_layer for r in records} == {heads.exit_layers[0]}
    assert {r.threshold_version for r in records} == {2}
