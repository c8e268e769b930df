"""The demo's exit heads ship with the package: small, pinned by digest, verified at load, and
made by the project's own training command as `DEMO_HEADS_COMMAND` says."""

import shlex
import shutil
import tomllib
from pathlib import Path

import click
import pytest

from exitplane.demo import DEMO_HEADS, DEMO_HEADS_COMMAND, DEMO_HEADS_SHA256, load_demo_heads
from runtime.heads import file_sha256, read_metadata
from runtime.model import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[1]


def _options(command: str) -> dict[str, str]:
    words = shlex.split(command)
    assert words[:3] == ["exitplane", "runtime", "train-heads"]
    return {words[i][2:]: words[i + 1] for i in range(3, len(words), 2)}


def test_the_shipped_file_is_small_and_pinned():
    assert DEMO_HEADS.stat().st_size < 5_000_000
    assert file_sha256(DEMO_HEADS) == DEMO_HEADS_SHA256
    sidecar = DEMO_HEADS.with_name(DEMO_HEADS.name + ".sha256").read_text().split()
    assert sidecar == [DEMO_HEADS_SHA256, DEMO_HEADS.name]


def test_the_file_is_what_the_documented_command_makes():
    options = _options(DEMO_HEADS_COMMAND)
    meta = read_metadata(DEMO_HEADS)
    config = meta["config"]
    assert meta["model"] == DEFAULT_MODEL and config["mode"] == options["mode"] == "post-hoc"
    assert meta["exit_layers"] == [int(k) for k in options["exit-layers"].split(",")]
    assert config["generation_prompts"] == int(options["prompts"])
    assert config["stdlib_chars"] == int(options["stdlib-chars"])
    assert config["adapter_steps"] == int(options["steps"])
    # every step ran: the budget never cut the training short
    assert meta["train_steps"] == int(options["steps"])
    assert Path(options["out"]) == DEMO_HEADS.relative_to(ROOT)


def test_the_package_data_ships_it():
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["exitplane"]
    for path in (DEMO_HEADS, DEMO_HEADS.with_name(DEMO_HEADS.name + ".sha256")):
        assert str(path.relative_to(ROOT / "exitplane")) in package_data


def test_load_verifies_the_pinned_digest(tmp_path):
    heads = load_demo_heads()
    assert heads.exit_layers == read_metadata(DEMO_HEADS)["exit_layers"]
    changed = tmp_path / DEMO_HEADS.name
    shutil.copy(DEMO_HEADS, changed)
    shutil.copy(DEMO_HEADS.with_name(DEMO_HEADS.name + ".sha256"),
                tmp_path / (DEMO_HEADS.name + ".sha256"))
    with changed.open("r+b") as handle:  # one byte of a tensor, far past the header
        handle.seek(-100, 2)
        byte = handle.read(1)
        handle.seek(-100, 2)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(click.ClickException, match="corrupt or was replaced"):
        load_demo_heads(changed)
    with pytest.raises(click.ClickException, match="missing"):
        load_demo_heads(tmp_path / "absent.safetensors")
