"""The operator commands: the control plane driven over its HTTP API (no database access), so
they run from any machine that can reach the API with a token."""

from __future__ import annotations

import click


def register(main: click.Group) -> None:
    """Add the operator groups and commands to the `exitplane` command; the root and each group
    also take the connection options (--url, --token-file, --output, --no-headers, --timeout)
    before the command's name."""
    from exitplane.ops.answers import deployments_answers  # noqa: F401 (registers)
    from exitplane.ops.api import group_connection_options
    from exitplane.ops.curve import deployments_curve, versions_what_if  # noqa: F401 (registers)
    from exitplane.ops.deployments import canary, deployments, rollback, segments, versions
    from exitplane.ops.hooks import hooks
    from exitplane.ops.operations import alerts, audit, calibrations, runtimes, tokens
    from exitplane.ops.savings import savings
    from exitplane.ops.users import users

    main.params.extend(group_connection_options())
    for command in (deployments, versions, rollback, canary, segments, calibrations, alerts,
                    runtimes, tokens, users, hooks, savings, audit):
        if isinstance(command, click.Group):
            command.params.extend(group_connection_options())
        main.add_command(command)
