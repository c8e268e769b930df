"""`exitplane runtime provision`: heads trained on a fresh volume, kept on a re-run, copied from an
artifact the operator points to, refused when that artifact is not heads, and re-provisioned
when the file on the volume no longer verifies. Then `serve --model tiny --heads` uses them."""

from __future__ import annotations

import json
import threading

import pytest
from click.testing import CliRunner

from runtime.cli import runtime_cli
from runtime.heads import ExitHeads
from runtime.provision import ProvisionError, provision, shipped_heads

QUICK = ["--stdlib-chars", "4000", "--prompts", "2", "--steps", "3", "--budget-s", "120"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EXITPLANE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("EXITPLANE_HEADS_FROM", raising=False)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Heads for the tiny model, trained once by the CLI on an empty volume."""
    volume = tmp_path_factory.mktemp("volume")
    target = volume / "heads.safetensors"
    result = CliRunner().invoke(runtime_cli, ["provision", "--heads", str(target), "--model",
                                              "tiny", *QUICK],
                                env={"EXITPLANE_CACHE_DIR": str(volume / "cache"),
                                     "EXITPLANE_HEADS_FROM": ""})
    assert result.exit_code == 0, result.output
    return target, json.loads(result.output.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_fresh_volume_gets_trained_heads_for_the_served_model(trained):
    target, outcome = trained
    assert outcome["action"] == "trained" and outcome["model"] == "tiny-llama"
    heads = ExitHeads.load(target)  # the sidecar verifies
    assert heads.exit_layers == [2, 4] and heads.metadata["num_layers"] == 6
    assert json.loads(target.with_name(target.name + ".provenance.json").read_text())[
        "action"] == "trained"


def test_a_rerun_is_a_noop(trained, cache):
    target, _ = trained
    before = target.stat().st_mtime_ns
    result = CliRunner().invoke(runtime_cli, ["provision", "--heads", str(target), "--model",
                                              "tiny", *QUICK])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1])["action"] == "kept"
    assert "nothing to do" in result.output
    assert target.stat().st_mtime_ns == before
    # Heads for other exit layers or another model are refused, not silently kept.
    layers = CliRunner().invoke(runtime_cli, ["provision", "--heads", str(target), "--model",
                                              "tiny", "--exit-layers", "1,3", *QUICK])
    assert layers.exit_code == 1
    assert "made for exit_layers [2, 4], not [1, 3]" in layers.output
    model = CliRunner().invoke(runtime_cli, ["provision", "--heads", str(target), "--model",
                                             "/models/other-model"])
    assert model.exit_code == 1 and "made for model 'tiny-llama'" in model.output
    assert target.stat().st_mtime_ns == before


def test_an_artifact_pointed_to_is_copied_through_the_environment(trained, tmp_path, cache):
    source, outcome = trained
    target = tmp_path / "other-volume" / "heads.safetensors"
    result = CliRunner().invoke(runtime_cli, ["provision", "--heads", str(target)],
                                env={"EXITPLANE_HEADS_FROM": str(source)})
    assert result.exit_code == 0, result.output
    copied = json.loads(result.output.strip().splitlines()[-1])
    assert copied["action"] == "copied" and copied["sha256"] == outcome["sha256"]
    assert "copying heads" in result.output  # the progress bar


def test_something_else_is_refused_and_nothing_is_left(tmp_path, cache):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not heads at all")
    target = tmp_path / "volume" / "heads.safetensors"
    result = CliRunner().invoke(runtime_cli, ["provision", "--heads", str(target), "--from",
                                              str(junk)])
    assert result.exit_code == 1
    assert "did not give an exitplane heads artifact" in result.output
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir()] == ["heads.safetensors.lock"]
    missing = CliRunner().invoke(runtime_cli, ["provision", "--heads", str(target), "--from",
                                               str(tmp_path / "nope")])
    assert missing.exit_code == 1 and "not found" in missing.output


def test_a_damaged_artifact_is_provisioned_again_and_concurrent_runs_train_once(trained,
                                                                                   tmp_path):
    source, outcome = trained
    target = tmp_path / "heads.safetensors"
    calls = []

    def train(out):
        calls.append(out)
        out.write_bytes(source.read_bytes())

    runs = [threading.Thread(target=provision, kwargs={"target": target, "source": None,
                                                       "train": train, "log": lambda _: None})
            for _ in range(3)]
    for run in runs:
        run.start()
    for run in runs:
        run.join()
    assert len(calls) == 1  # the lock serialised them; the later ones found it done
    with target.open("r+b") as handle:  # a bit flipped on disk
        handle.seek(-1, 2)
        last = handle.read(1)
        handle.seek(-1, 2)
        handle.write(bytes([last[0] ^ 1]))
    again = provision(target=target, source=None, train=train, log=lambda _: None)
    assert again["action"] == "trained" and again["sha256"] == outcome["sha256"]
    assert len(calls) == 2
    with pytest.raises(ProvisionError):
        provision(target=tmp_path / "x.safetensors", source=None,
                  train=lambda out: out.write_text("no"), log=lambda _: None)


def test_the_shipped_heads_are_copied_by_name(tmp_path, cache):
    target = tmp_path / "volume" / "heads.safetensors"
    result = CliRunner().invoke(runtime_cli, ["provision", "--heads", str(target)],
                                env={"EXITPLANE_HEADS_FROM": "shipped"})
    assert result.exit_code == 0, result.output
    copied = json.loads(result.output.strip().splitlines()[-1])
    assert copied["action"] == "copied"
    assert target.read_bytes() == shipped_heads().read_bytes()
    assert ExitHeads.load(target).exit_layers == [12, 15, 18, 21, 24, 27]
