"""CLI niceties: `exitplane --version`, help text on every option of every command (the runtime's
included), no option spelled twice on one command, shell completion (bash, zsh and fish
scripts from click's `_EXITPLANE_COMPLETE`, completing command names without the hidden
deprecated ones), and the progress bar of corpus generation (the others: provisioning in
tests/runtime/test_provision.py, calibration in tests/controlplane/calibration/test_cli.py,
head training's phases in runtime/train.py)."""

from __future__ import annotations

from importlib.metadata import version

import click
import pytest
from click.testing import CliRunner

from exitplane.cli import main


def _options_without_help(command: click.Command, path: list[str],
                          ctx: click.Context) -> list[str]:
    missing = [f"{' '.join(path)} {'/'.join(p.opts)}" for p in command.params
               if isinstance(p, click.Option) and not p.help and "--help" not in p.opts]
    if isinstance(command, click.Group):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            missing += _options_without_help(sub, [*path, name],
                                             click.Context(sub, parent=ctx, info_name=name))
    return missing


def _commands(command: click.Command, ctx: click.Context) -> int:
    if not isinstance(command, click.Group):
        return 1
    return sum(_commands(command.get_command(ctx, name),
                         click.Context(command.get_command(ctx, name), parent=ctx,
                                       info_name=name))
               for name in command.list_commands(ctx))


def test_version():
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"exitplane, version {version('exitplane')}"


def test_every_option_has_help_text():
    ctx = click.Context(main, info_name="exitplane")
    assert _commands(main, ctx) >= 15  # the walk reached the runtime's lazy group too
    assert _options_without_help(main, ["exitplane"], ctx) == []


def _duplicated_options(command: click.Command, path: list[str],
                        ctx: click.Context) -> list[str]:
    spelled = [opt for p in command.params if isinstance(p, click.Option) for opt in p.opts]
    found = [f"{' '.join(path)} {opt}" for opt in sorted(set(spelled)) if spelled.count(opt) > 1]
    if isinstance(command, click.Group) and path[-1] != "runtime":
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            found += _duplicated_options(sub, [*path, name],
                                         click.Context(sub, parent=ctx, info_name=name))
    return found


def test_no_command_spells_an_option_twice():
    """A command's own option and a connection option of the same name would shadow each
    other (click only warns)."""
    assert _duplicated_options(main, ["exitplane"], click.Context(main,
                                                                  info_name="exitplane")) == []


@pytest.mark.parametrize("shell,marker", [("bash", "complete -o nosort -F"),
                                          ("zsh", "#compdef exitplane"),
                                          ("fish", "complete --no-files --command exitplane")])
def test_shell_completion_scripts(shell, marker):
    import os
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([str(Path(sys.executable).parent / "exitplane")], text=True,
                          capture_output=True, timeout=120,
                          env={**os.environ, "_EXITPLANE_COMPLETE": f"{shell}_source"})
    assert done.returncode == 0, done.stderr
    assert marker in done.stdout and "_EXITPLANE_COMPLETE" in done.stdout


def _completions(monkeypatch, words: str) -> set[str]:
    """What bash completion offers after `words` (click's bash_complete protocol)."""
    monkeypatch.setenv("_EXITPLANE_COMPLETE", "bash_complete")
    monkeypatch.setenv("COMP_WORDS", words)
    monkeypatch.setenv("COMP_CWORD", str(len(words.split()) - 1))
    result = CliRunner().invoke(main, [], prog_name="exitplane")
    return {line.split(",", 1)[1] for line in result.stdout.splitlines()}


def test_completion_offers_the_plural_groups_only(monkeypatch):
    assert _completions(monkeypatch, "exitplane de") == {"dead-letters", "demo", "deployments"}
    assert _completions(monkeypatch, "exitplane to") == {"tokens"}  # not the hidden `token`
    assert _completions(monkeypatch, "exitplane deployments d") == {"delete"}


def test_an_option_without_help_would_be_found():
    @click.command()
    @click.option("--quiet", is_flag=True)
    def bare(quiet):
        """A command someone forgot to document."""

    assert _options_without_help(bare, ["bare"], click.Context(bare)) == ["bare --quiet"]


def test_corpus_generation_shows_progress(tmp_path, monkeypatch, capsys):
    from runtime import corpus
    from runtime.engine import Engine, EngineConfig
    from runtime.model import tiny_llama
    from runtime.testing import ascii_tokenizer

    monkeypatch.setenv("EXITPLANE_CACHE_DIR", str(tmp_path))
    engine = Engine(tiny_llama(), config=EngineConfig(max_batch=2, max_seq_len=128))
    prompts = ["one", "two", "three"]
    sequences = corpus.generations(engine, ascii_tokenizer(), prompts, max_new_tokens=4,
                                   model_name="tiny")
    assert len(sequences) == 3
    assert "corpus: 100%" in capsys.readouterr().err  # 2 batches of at most max_batch
    again = corpus.generations(engine, ascii_tokenizer(), prompts, max_new_tokens=4,
                               model_name="tiny")
    assert again == sequences


@pytest.mark.slow  # runs the CLI's processes
def test_a_bad_log_setting_is_one_line_not_a_traceback(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    exitplane = str(Path(sys.executable).parent / "exitplane")
    env = {**os.environ, "EXITPLANE_LOG_FORMAT": "xml", "EXITPLANE_VAR_DIR": str(tmp_path)}
    api = subprocess.run([exitplane, "up", "--no-workers"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert api.returncode == 2
    assert api.stderr == ("exitplane: invalid setting EXITPLANE_LOG_FORMAT: Input should be "
                          "'json' or 'text'\n")
    runtime = subprocess.run([exitplane, "runtime", "provision", "--heads",
                              str(tmp_path / "h.safetensors")], env=env, capture_output=True,
                             text=True, timeout=120)
    assert runtime.returncode == 1
    assert runtime.stderr.strip() == "Error: EXITPLANE_LOG_FORMAT must be json or text, not 'xml'"
