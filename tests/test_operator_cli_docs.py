"""The operator CLI guide (docs/guides/operator-cli.md) says what the program does: every
`exitplane` command in its console blocks parses (known groups, commands and options, every
required option given: `--reason` where one is needed), and its session, run command by
command against a control plane started with `exitplane up`, ends with the documented exit
status and prints the documented lines (numbers, times and column widths aside)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from exitplane.cli import main
from tests.support.operator_plane import served_plane

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "operator-cli.md"


def console_blocks(text: str) -> list[tuple[str, list[tuple[str, list[str]]]]]:
    """(the heading above it, [(command, output lines)]) for each ```console block."""
    blocks, heading = [], ""
    for match in re.finditer(r"^(## [^\n]*)$|^```console\n(.*?)^```$", text, flags=re.S | re.M):
        if match.group(1):
            heading = match.group(1)[3:].strip()
            continue
        steps: list[tuple[str, list[str]]] = []
        command = ""
        for line in match.group(2).splitlines():
            if line.startswith("$ "):
                command = line[2:]
                steps.append((command, []))
            elif command.endswith("\\") and steps and not steps[-1][1]:
                command = command[:-1] + line.strip()
                steps[-1] = (command, [])
            elif steps:
                steps[-1][1].append(line)
        blocks.append((heading, steps))
    return blocks


def split(command: str) -> tuple[dict[str, str], list[str], bool, bool]:
    """A documented command line: its VAR=value prefixes, the `exitplane` arguments, whether
    a pipe follows and whether `; echo $?` prints the exit status."""
    words = shlex.split(command, comments=True)
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    status = False
    piped = "|" in words
    if piped:
        words = words[:words.index("|")]
    if "$?" in command:
        status = True
        words = [w for w in words if w not in ("echo", "$?")]
        words[-1] = words[-1].rstrip(";")
    return env, words, piped, status


def exitplane_commands() -> list[tuple[str, list[str]]]:
    found = []
    for _, steps in console_blocks(GUIDE.read_text()):
        for command, _ in steps:
            _, words, _, _ = split(command)
            if words and words[0] == "exitplane":
                found.append((command, words[1:]))
    return found


def parsed_command(args: list[str]) -> click.Command:
    """The command `args` names, after click parsed every level (a bad option, an unknown
    command or a missing required option raises)."""
    ctx = main.make_context("exitplane", list(args))
    command: click.Command = main
    while isinstance(command, click.Group):
        rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
        name, command, rest = command.resolve_command(ctx, rest)
        ctx = command.make_context(name, rest, parent=ctx)
    return command


def test_the_guide_shows_commands():
    commands = exitplane_commands()
    assert len(commands) >= 20
    assert any(args[:2] == ["deployments", "delete"] for _, args in commands)


@pytest.mark.parametrize("command,args", exitplane_commands(),
                         ids=[command[:60] for command, _ in exitplane_commands()])
def test_every_documented_command_parses(command, args):
    leaf = parsed_command(args)
    assert not leaf.hidden, f"{command}: documents a deprecated spelling"
    required = {p.name for p in leaf.params if isinstance(p, click.Option) and p.required}
    if "reason" in required:
        assert "--reason" in args, command


def normal(line: str) -> str:
    """A line with its numbers as N and its runs of spaces as one (times, ids and column
    widths differ from run to run)."""
    return " ".join(re.sub(r"\d+(\.\d+)?", "N", line).split())


@pytest.mark.slow  # runs `exitplane up`
def test_the_session_runs_as_documented(sqlite_template, tmp_path):
    session = next(steps for heading, steps in console_blocks(GUIDE.read_text())
                   if heading == "A session")
    assert len(session) >= 10
    with served_plane(sqlite_template, tmp_path) as plane:
        for command, shown in session:
            env, words, piped, status = split(command)
            assert words[0] == "exitplane", command
            code = int(shown[-1]) if status else 0
            ran = plane.run(*words[1:], code=code, process=False,
                            **{key: value or None for key, value in env.items()})
            if piped:
                continue
            printed = {normal(line) for line in (ran.stdout + ran.stderr).splitlines()}
            for line in shown[:-1] if status else shown:
                assert normal(line) in printed, (command, line, ran)
