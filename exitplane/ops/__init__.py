"""The operator commands: the control plane driven over its HTTP API (no database access), so
they run from any machine that can reach the API with a token."""

from __future__ import annotations

import click


def register(main: click.Group) -> None:
    """Add the operator groups and commands to the `exitplane` command."""
    from exitplane.ops.curve import deployments_curve, versions_what_if  # noqa: F401 (registers)
    from exitplane.ops.deployments import canary, deployments, rollback, segments, versions
    from exitplane.ops.operations import alerts, audit, calibrations, runtimes, tokens
    from exitplane.ops.savings import savings

    for command in (deployments, versions, rollback, canary, segments, calibrations, alerts,
                    runtimes, tokens, savings, audit):
        main.add_command(command)
