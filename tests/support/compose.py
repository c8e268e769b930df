"""The docker-compose.yml stack as data, and the `exitplane` commands its containers run, parsed
by the real CLI without running them."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import yaml

from exitplane.cli import main

COMPOSE = yaml.safe_load((Path(__file__).parents[2] / "docker-compose.yml").read_text())


def exitplane_invocations(command) -> list[list[str]]:
    """The `exitplane` commands a container command runs (each its arguments after
    `exitplane`), in a list or in an `sh -c` line."""
    text = command if isinstance(command, str) else shlex.join(command)
    if isinstance(command, list) and command[:2] == ["sh", "-c"]:
        text = command[2]
    found = []
    for part in re.split(r"&&|;", text):
        words = [w for w in shlex.split(part) if w != "exec"]
        if words and words[0] == "exitplane":
            found.append(words[1:])
    return found


def parse_invocation(args: list[str]) -> click.Command:
    """Resolve args to a command and parse its options, without running it."""
    command: click.Command = main
    ctx = click.Context(main, info_name="exitplane")
    while isinstance(command, click.Group):
        name, args = args[0], args[1:]
        sub = command.get_command(ctx, name)
        assert sub is not None, f"exitplane has no command {name!r}"
        ctx = click.Context(sub, info_name=name, parent=ctx)
        command = sub
    # Values from the environment take their compose defaults, or a placeholder.
    args = [re.sub(r"\$\{[^}]+\}", "x", re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", a))
            for a in args]
    command.make_context(command.name, list(args), parent=ctx.parent)
    return command
