"""bench/answers.py on the tiny random model: the pool of shadow requests is built once and read
back from its cache, the exact answer loss (`first_divergence` on the pool's labels) predicts
what real early-exit generation answers, token for token, under sets that do exit, and the
run prints one JSON line with the figures docs/benchmarks.md quotes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.support.benches import load_bench

pytestmark = pytest.mark.slow
ARGS = ["--model", "tiny", "--heads", "none", "--prompts-per-domain", "6", "--new-tokens", "10",
        "--trials", "3", "--calibration", "8", "--verify", "3", "--verify-trials", "1",
        "--min-samples-per-layer", "10", "--batch", "4"]


def _bench():
    return load_bench("answers")


def test_the_run_and_its_cached_pool(tmp_path, capsys):
    bench = _bench()
    first = bench.main([*ARGS, "--cache-dir", str(tmp_path)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("$ bench/answers.py --model tiny")
    assert json.loads(lines[-1]) == first
    assert first["pool_requests"] == 12 and first["domains"] == ["code", "docs"]
    assert not first["pool_cached"] and first["fresh_requests"] == 4
    for key in ("answer_violation_rate", "epsilon", "delta_answer", "answer_exit_rate",
                "token_only_answers_differ", "exact_vs_real_agreement"):
        assert key in first
    assert first["verified_requests"] == 6
    again = bench.main([*ARGS, "--cache-dir", str(tmp_path), "--trials", "1"])
    assert again["pool_cached"] and again["pool_tokens"] == first["pool_tokens"]


def test_the_exact_loss_predicts_real_generation(tmp_path):
    """Under sets that exit often (thresholds at quantiles of the pool's own signals), every
    request's predicted first divergence is where the real early-exit answer first differs."""
    bench = _bench()
    args = bench.parse_args([*ARGS, "--cache-dir", str(tmp_path)])
    model, tokenizer, heads, name = bench.load_served_model(args)
    pool, _ = bench.build_pool(args, model, tokenizer, heads, name)
    from runtime.engine import Engine, EngineConfig

    engine = Engine(model, heads=heads, config=EngineConfig(max_batch=4, max_seq_len=1024))
    layers = engine.exit_layers
    picks = np.arange(len(pool.domains))
    found = []
    for q in (0.3, 0.6, 0.9):
        levels = np.nanquantile(pool.signals, q, axis=0)
        thresholds = {layer: float(levels[j]) for j, layer in enumerate(layers)}
        found += bench.verify(engine, pool, picks, thresholds, layers,
                              new_tokens=args.new_tokens)
    predicted = np.array([p for p, _ in found])
    real = np.array([r for _, r in found])
    assert (predicted >= 0).any() and (predicted < 0).any()  # both outcomes are exercised
    np.testing.assert_array_equal(predicted, real)
