"""Exit heads artifacts, signals and LoRA merging."""

from __future__ import annotations

import math

import pytest
import torch

from runtime import signals
from runtime.heads import ExitHeads, merge_lora, read_metadata
from runtime.model import decoder_parts, tiny_llama


def make_heads(seed: int = 0) -> ExitHeads:
    torch.manual_seed(seed)
    heads = ExitHeads(exit_layers=[2, 4], hidden_size=64, eps=1e-5,
                      metadata={"model": "tiny", "mode": "post-hoc",
                                "heldout": {"2": {"agreement": 0.4}}})
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_()
    heads.lora = {"0.q_proj.A": torch.randn(4, 64), "0.q_proj.B": torch.randn(64, 4)}
    return heads


def test_heads_save_load_round_trip(tmp_path):
    heads = make_heads()
    path = tmp_path / "heads.safetensors"
    digest = heads.save(path)
    assert (tmp_path / "heads.safetensors.sha256").read_text().split() == [digest, path.name]
    loaded = ExitHeads.load(path)
    assert loaded.digest == digest
    assert loaded.exit_layers == [2, 4]
    assert loaded.metadata["heldout"] == {"2": {"agreement": 0.4}}
    for (name, a), (_, b) in zip(heads.state_dict().items(), loaded.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(loaded.lora["0.q_proj.B"], heads.lora["0.q_proj.B"])
    hidden = torch.randn(3, 64)
    assert torch.equal(heads.match_probability(2, hidden), loaded.match_probability(2, hidden))
    assert read_metadata(path)["exit_layers"] == [2, 4]


def test_tampered_artifact_is_refused(tmp_path):
    path = tmp_path / "heads.safetensors"
    make_heads().save(path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256"):
        ExitHeads.load(path)


def test_wrong_expected_digest_is_refused(tmp_path):
    path = tmp_path / "heads.safetensors"
    make_heads().save(path)
    with pytest.raises(ValueError, match="expected"):
        ExitHeads.load(path, expected_digest="0" * 64)


def test_signals_are_confidences_in_unit_interval():
    uniform = torch.zeros(1, 100)
    peaked = torch.tensor([[10.0, 0.0, 0.0, 0.0]])
    assert signals.entropy_confidence(uniform).item() == pytest.approx(0.0, abs=1e-6)
    assert signals.entropy_confidence(torch.tensor([[100.0, 0, 0]])).item() == \
        pytest.approx(1.0, abs=1e-4)
    p1 = math.exp(10) / (math.exp(10) + 3)
    assert signals.maxprob(peaked).item() == pytest.approx(p1, rel=1e-5)
    assert signals.margin(peaked).item() == pytest.approx(p1 - 1 / (math.exp(10) + 3), rel=1e-5)
    run = torch.zeros(2)
    prev = torch.tensor([-1, -1])
    value, run = signals.saturation(torch.tensor([5, 6]), prev, run)
    assert value.tolist() == [0.0, 0.0]
    value, run = signals.saturation(torch.tensor([5, 7]), torch.tensor([5, 6]), run)
    assert value.tolist() == [0.5, 0.0]
    value, run = signals.saturation(torch.tensor([5, 7]), torch.tensor([5, 7]), run)
    assert value.tolist() == pytest.approx([2 / 3, 0.5])


def test_merge_lora_adds_low_rank_delta():
    model = tiny_llama(seed=1)
    parts = decoder_parts(model)
    before = parts.layers[1].mlp.down_proj.weight.clone()
    a, b = torch.randn(2, 128), torch.randn(64, 2)
    assert merge_lora(model, {"1.down_proj.A": a, "1.down_proj.B": b}, 0.5) == 1
    torch.testing.assert_close(parts.layers[1].mlp.down_proj.weight, before + 0.5 * b @ a)


def test_a_slow_corpus_does_not_starve_the_training_phase():
    from runtime.train import phase_deadline

    # On time: the phase ends at its share of the budget.
    assert phase_deadline(started=0.0, now=10.0, budget_s=100.0, share=0.75) == 75.0
    # Text generation and the teacher pass took 90 of 100 s: the phase still gets 40 s.
    assert phase_deadline(started=0.0, now=90.0, budget_s=100.0, share=0.75) == 130.0
