"""Compose: the runtime port stays on the compose network unless the
operator opts in with docker-compose.runtime-public.yml, which publishes it and makes the
runtime require API keys read from a compose secret. (No Docker engine here: the files are
checked, and the CLI is shown to pick the key file up from the override's environment.)"""

from __future__ import annotations

from pathlib import Path

import click
import yaml

from exitplane.cli import main
from tests.support.compose import exitplane_invocations

ROOT = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
PUBLIC = yaml.safe_load((ROOT / "docker-compose.runtime-public.yml").read_text())


def test_the_runtime_port_is_not_published_by_default():
    runtime = BASE["services"]["runtime"]
    assert "ports" not in runtime
    assert runtime.get("expose") == ["8100"]
    assert "--api-key-file" not in runtime["command"]  # internal: no key needed


def test_publishing_the_port_requires_a_key_from_a_secret(tmp_path, monkeypatch):
    runtime = PUBLIC["services"]["runtime"]
    assert runtime["ports"] == ["8100:8100"]
    key_path = runtime["environment"]["EXITPLANE_RUNTIME_API_KEY_FILE"]
    assert key_path == "/run/secrets/runtime_api_keys"
    # The override adds only the key secret; the runtime's token comes from the bootstrap volume.
    assert runtime["secrets"] == ["runtime_api_keys"]
    assert PUBLIC["secrets"]["runtime_api_keys"]["file"].startswith("./secrets/")
    assert set(PUBLIC["services"]) == {"runtime"}  # the override touches nothing else

    # The base service's own command, with the override's environment, reads the key file.
    key_file = tmp_path / "runtime_api_keys"
    key_file.write_text("k-" + "0123456789abcdef" * 2 + "\n")
    monkeypatch.setenv("EXITPLANE_RUNTIME_API_KEY_FILE", str(key_file))
    (args,) = exitplane_invocations(BASE["services"]["runtime"]["command"])
    ctx = click.Context(main, info_name="exitplane")
    group = main.get_command(ctx, args[0])
    serve = group.get_command(ctx, args[1])
    words = [w.replace("${EXITPLANE_DEPLOYMENT:-chat}", "chat") for w in args[2:]]
    parsed = serve.make_context("serve", words, parent=ctx)
    assert parsed.params["api_key_file"] == str(key_file)
