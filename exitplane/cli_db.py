"""`exitplane db ...`: where the database schema stands, its history, upgrade and downgrade, and
the migrations' SQL for a DBA to review or apply (Alembic is the only way the schema changes)."""

from __future__ import annotations

import io
import re

import click

from exitplane.ops.api import REFUSED
from exitplane.ops.api import fail as _fail


def _url() -> str:
    from controlplane.settings import get_settings

    return get_settings().effective_database_url


def _redact(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def _script():
    from alembic.script import ScriptDirectory

    from controlplane.migrate import alembic_config

    return ScriptDirectory.from_config(alembic_config(_url()))


def _alembic(action, *args, **kwargs) -> None:
    """Run an Alembic command; a revision it does not know ends the command with one line."""
    from alembic.util.exc import CommandError

    try:
        action(*args, **kwargs)
    except CommandError as error:
        _fail(str(error))


def _offline_sql(action, url: str, revision: str) -> None:
    """Print the SQL of `action` (upgrade or downgrade) over `revision` ('from:to')."""
    from controlplane.migrate import alembic_config

    config = alembic_config(url)
    config.output_buffer = io.StringIO()
    try:
        _alembic(action, config, revision, sql=True)
    except (AttributeError, TypeError, NotImplementedError):
        # A migration that reads stored rows (bind.execute(...).all()) cannot be SQL text.
        steps = re.findall(r"-- Running (?:up|down)grade .* -> (\S+)",
                           config.output_buffer.getvalue())
        where = f"revision {steps[-1]}" if steps else "the first revision"
        _fail(f"{where} rewrites stored rows and cannot be written as SQL; apply it with "
              f"`exitplane db upgrade --revision {steps[-1] if steps else 'REVISION'}`, then "
              "ask for the SQL of what follows with --from")
    click.echo(config.output_buffer.getvalue(), nl=False)


@click.group()
def db() -> None:
    """Database schema (Alembic is the only way it changes)."""


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True,
              help="the Alembic revision to upgrade to")
@click.option("--sql", "as_sql", is_flag=True,
              help="print the SQL instead of running it (no database connection), for a DBA "
                   "to review or apply; its dialect is the configured database's")
@click.option("--from", "from_revision", default=None,
              help="with --sql: the revision the database is at (default: an empty database)")
def db_upgrade(revision: str, as_sql: bool, from_revision: str | None) -> None:
    """Apply migrations to the configured database (or print their SQL with --sql)."""
    from alembic import command

    from controlplane.migrate import upgrade

    url = _url()
    if as_sql:
        _offline_sql(command.upgrade, url,
                     f"{from_revision}:{revision}" if from_revision else revision)
        return
    if from_revision:
        _fail("--from goes with --sql; a live upgrade starts where the database is")
    _alembic(upgrade, url, revision)
    click.echo(f"database at {_redact(url)} is at {revision}")


@db.command("downgrade")
@click.argument("revision")
@click.option("--sql", "as_sql", is_flag=True,
              help="print the SQL instead of running it (needs --from)")
@click.option("--from", "from_revision", default=None,
              help="with --sql: the revision the database is at, e.g. head")
@click.option("--yes", is_flag=True, help="do not ask for confirmation")
def db_downgrade(revision: str, as_sql: bool, from_revision: str | None, yes: bool) -> None:
    """Undo migrations down to REVISION (e.g. -1 for one step). Tables and columns that later
    migrations added are dropped with their data."""
    from alembic import command

    from controlplane.migrate import downgrade

    url = _url()
    if as_sql:
        if not from_revision:
            _fail("downgrade --sql needs --from REVISION (the revision the database is at)")
        _offline_sql(command.downgrade, url, f"{from_revision}:{revision}")
        return
    if not yes and not click.confirm(
            f"downgrade the database at {_redact(url)} to {revision}? Data that later "
            "migrations hold is lost", err=True):
        _fail("nothing changed")
    _alembic(downgrade, url, revision)
    click.echo(f"database at {_redact(url)} is at {revision}")


def _current(url: str) -> frozenset[str]:
    from controlplane.db import make_engine
    from controlplane.migrate import stored_revisions

    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            return stored_revisions(connection)
    finally:
        engine.dispose()


@db.command("current")
def db_current() -> None:
    """The revision the configured database is at, and whether that is the newest (head).
    Exits 1 with one line when the database has no schema yet or is behind this release's
    head (the API is not ready until `exitplane db upgrade` has run), 0 otherwise."""
    from controlplane.migrate import head_revisions, not_migrated

    url = _url()
    at = _current(url)
    heads = head_revisions()
    for revision in sorted(at):
        click.echo(f"{revision}{' (head)' if revision in heads else ''}")
    problem = not_migrated(at)
    if problem:
        _fail(f"database at {_redact(url)}: {problem}", REFUSED)
    if at != heads:
        click.echo(f"this release does not know {', '.join(sorted(at - heads))} (a newer "
                   f"release migrated the database); its head is {', '.join(sorted(heads))}",
                   err=True)


@db.command("history")
def db_history() -> None:
    """Every migration, newest first: revision, what it came after, what it does (no database
    connection needed)."""
    heads = set(_script().get_heads())
    for script in _script().walk_revisions():
        down = script.down_revision
        after = ", ".join(down) if isinstance(down, tuple) else down or "(base)"
        title = (script.doc or "").strip().splitlines()[0] if script.doc else ""
        mark = " (head)" if script.revision in heads else ""
        click.echo(f"{script.revision}{mark} <- {after}: {title}")
