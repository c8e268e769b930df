"""The `runtime` click group end to end on a tiny checkpoint with the real tokenizer."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from exitplane.wire import ThresholdSetWire
from runtime.cli import runtime_cli
from runtime.heads import ExitHeads
from runtime.model import load_model, tiny_llama
from runtime.testing import ascii_tokenizer


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A 6-layer random Llama with a character tokenizer, saved as a local HF checkpoint."""
    tokenizer = ascii_tokenizer()
    model = tiny_llama(seed=3, vocab_size=len(tokenizer), hidden_size=64)
    folder = tmp_path_factory.mktemp("tiny-ckpt")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EXITPLANE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_load_local_checkpoint(tiny_checkpoint):
    model, tokenizer = load_model(tiny_checkpoint)
    assert len(model.model.layers) == 6
    assert tokenizer("hello")["input_ids"]


def test_generate_prints_text_and_exit_summary(tiny_checkpoint, cache, tmp_path):
    thresholds = tmp_path / "thresholds.json"
    wire = ThresholdSetWire.build(deployment="tiny", version=5, signal="maxprob",
                                  thresholds={2: 0.0, 4: 1.0})
    thresholds.write_text(wire.model_dump_json())
    result = CliRunner().invoke(runtime_cli, [
        "generate", "--prompt", "Say hi", "--model", str(tiny_checkpoint), "--thresholds",
        str(thresholds), "--max-new-tokens", "6", "--stream"])
    assert result.exit_code == 0, result.output
    assert "threshold version 5" in result.output
    assert "layer   2:     6" in result.output


def test_generate_rejects_tampered_threshold_file(tiny_checkpoint, cache, tmp_path):
    wire = ThresholdSetWire.build(deployment="tiny", version=5, signal="maxprob",
                                  thresholds={2: 0.5, 4: 1.0})
    data = json.loads(wire.model_dump_json())
    data["thresholds"]["2"] = 0.1
    path = tmp_path / "thresholds.json"
    path.write_text(json.dumps(data))
    result = CliRunner().invoke(runtime_cli, [
        "generate", "--prompt", "hi", "--model", str(tiny_checkpoint), "--thresholds", str(path)])
    assert result.exit_code == 2  # one line, no traceback
    assert result.output == (f"Error: {path} is not a threshold set: checksum mismatch for "
                             "tiny v5\n")


def test_an_offline_threshold_file_may_hold_segment_maps(tmp_path):
    from runtime.cli import read_threshold_file

    path = tmp_path / "thresholds.json"
    path.write_text(json.dumps({"signal": "maxprob", "thresholds": {"2": 0.9, "4": 0.8},
                                "segments": {"code": {"2": 1.0, "4": 0.97}}}))
    wire = read_threshold_file(str(path))
    wire.verify()
    assert wire.for_segment("code") == {2: 1.0, 4: 0.97}
    assert wire.for_segment("chat") == wire.thresholds == {2: 0.9, 4: 0.8}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["post-hoc", "joint"])
def test_train_heads_writes_verified_artifact(tiny_checkpoint, cache, mode):
    out = cache / f"heads-{mode}.safetensors"
    result = CliRunner().invoke(runtime_cli, [
        "train-heads", "--model", str(tiny_checkpoint), "--mode", mode, "--out", str(out),
        "--exit-layers", "2,4", "--stdlib-chars", "6000", "--prompts", "3", "--steps", "4",
        "--budget-s", "120"])
    assert result.exit_code == 0, result.output
    heads = ExitHeads.load(out)
    assert heads.exit_layers == [2, 4]
    meta = heads.metadata
    assert meta["mode"] == mode
    assert set(meta["heldout"]) == {"2", "4"}
    assert all(0.0 <= row["agreement"] <= 1.0 for row in meta["heldout"].values())
    assert meta["data"]["tokens"] > 1000
    assert (len(heads.lora) > 0) == (mode == "joint")
    assert f"sha256={heads.digest}" in result.output
