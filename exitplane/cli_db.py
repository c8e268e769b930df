"""The commands that need database access (they run where EXITPLANE_DATABASE_URL reaches the
store, e.g. on the control plane's host):

- `exitplane db ...`: where the database schema stands, its history, upgrade and downgrade,
  and the migrations' SQL for a DBA to review or apply (Alembic is the only way the schema
  changes);
- `exitplane bootstrap ...`: what must exist before any API token does (the first admin
  token, the first UI user) and the idempotent steps of a bootstrap job (a deployment, a
  runtime token file). With a token the same objects are managed over the API (`exitplane
  tokens`, `users`, `deployments`);
- the singular groups `token`, `deployment`, `segment`, `user` and the `calibrate` command,
  hidden and deprecated: each says so in one line on stderr, then runs (a command the singular
  group lacks runs from the plural group: `exitplane token list` is `exitplane tokens list`).
"""

from __future__ import annotations

import io
import re

import click

from exitplane.ops.api import REFUSED, new_token_options
from exitplane.ops.api import fail as _fail
from exitplane.ops.deployments import deployments
from exitplane.ops.operations import tokens
from exitplane.ops.users import PASSWORD_FILE, ROLE_HELP, ROLES, read_password, users
from exitplane.wire import DEFAULT_EXIT_LAYERS_RULE, Signal


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


# -- bootstrap: what needs the database because no token exists yet ---------------------------

@click.group()
def bootstrap() -> None:
    """Set-up that needs database access (run where EXITPLANE_DATABASE_URL reaches the store):
    the first admin token, the first UI user, and a bootstrap job's idempotent steps. With an
    admin token the same objects are managed over the API: `exitplane tokens`, `users`,
    `deployments`."""


@bootstrap.command("token")
@new_token_options
@click.option("--if-missing", is_flag=True,
              help="with --out: keep an existing token file and create nothing (a re-run of a "
                   "bootstrap step is a no-op)")
def bootstrap_token(name: str, scope: str, deployment: str | None, out_file: str | None,
                    if_missing: bool) -> None:
    """Create an API token in the database and print it once (or write it to --out): the
    first admin token, or a bootstrap job's runtime token."""
    from pathlib import Path

    if if_missing and not out_file:
        _fail("--if-missing needs --out FILE")
    if if_missing and Path(out_file).exists() and Path(out_file).read_text().strip():
        click.echo(f"token file {out_file} exists; kept", err=True)
        return
    from controlplane.auth.service import create_token
    from controlplane.db import session_scope
    from controlplane.deployments.service import get_deployment
    from controlplane.errors import DomainError
    from exitplane.ops.api import write_token_file

    try:
        with session_scope() as session:
            target = get_deployment(session=session, name=deployment) if deployment else None
            _, secret = create_token(session=session, name=name, scope=scope, deployment=target,
                                     actor="cli:bootstrap")
    except DomainError as error:
        _fail(str(error))
    if out_file:
        write_token_file(out_file, secret)
        click.echo(f"wrote the {scope} token {name!r} to {out_file}", err=True)
        return
    click.echo(secret)


@bootstrap.command("deployment")
@click.option("--name", required=True, help="the deployment's name, e.g. chat")
@click.option("--model-ref", required=True, help="the model the runtimes serve")
@click.option("--num-layers", type=int, required=True, help="decoder layers of that model")
@click.option("--exit-layers", default=None,
              help=f"comma-separated exit layers, as the runtime's heads were trained "
                   f"(default: {DEFAULT_EXIT_LAYERS_RULE})")
@click.option("--signal", default="learned", show_default=True,
              type=click.Choice([signal.value for signal in Signal]),
              help="the exit signal thresholds apply to")
@click.option("--delta", type=float, default=0.01, show_default=True,
              help="max disagreement with the full model")
@click.option("--epsilon", type=float, default=0.05, show_default=True,
              help="1 - confidence of the disagreement bound")
@click.option("--shadow-rate-min", type=float, default=0.01, show_default=True,
              help="the lowest shadow rate the control plane may ask runtimes for")
@click.option("--shadow-rate-max", type=float, default=0.2, show_default=True,
              help="the highest shadow rate it may ask for (equal to the minimum: fixed)")
def bootstrap_deployment(name: str, model_ref: str, num_layers: int, exit_layers: str | None,
                         signal: str, delta: float, epsilon: float, shadow_rate_min: float,
                         shadow_rate_max: float) -> None:
    """Create the deployment in the database if it is missing; a re-run with the same
    settings is a no-op, with other settings a refusal (over the API: `exitplane deployments
    create`)."""
    from pydantic import ValidationError

    from controlplane.db import session_scope
    from controlplane.deployments.schemas import DeploymentCreate
    from controlplane.deployments.service import create_deployment, get_deployment
    from controlplane.errors import DomainError, NotFound

    try:
        layers = [int(x) for x in exit_layers.split(",")] if exit_layers else None
        spec = DeploymentCreate(name=name, model_ref=model_ref, num_layers=num_layers,
                                exit_layers=layers, signal=signal, delta=delta, epsilon=epsilon,
                                shadow_rate_min=shadow_rate_min,
                                shadow_rate_max=shadow_rate_max)
    except (ValueError, ValidationError) as error:
        _fail(f"invalid deployment settings: {error}".splitlines()[0])
    wanted = spec.model_dump(include={"model_ref", "num_layers", "exit_layers", "signal",
                                      "delta", "epsilon", "shadow_rate_min",
                                      "shadow_rate_max"})
    try:
        with session_scope() as session:
            try:
                existing = get_deployment(session=session, name=name)
            except NotFound:
                create_deployment(session=session, spec=spec, actor="cli:bootstrap")
                click.echo(f"deployment {name!r} created", err=True)
                return
            differs = {key: getattr(existing, key) for key, value in wanted.items()
                       if getattr(existing, key) != value}
    except DomainError as error:
        _fail(str(error))
    if differs:
        _fail(f"deployment {name!r} exists with different settings {differs}; change them "
              f"with `exitplane deployments update {name}` or pick another name")
    click.echo(f"deployment {name!r} exists with these settings; nothing to do", err=True)


@bootstrap.command("user")
@click.option("--username", required=True, help="the sign-in name")
@click.option("--role", type=click.Choice(ROLES), required=True, help=ROLE_HELP)
@PASSWORD_FILE
def bootstrap_user(username: str, role: str, password_file: str | None) -> None:
    """Create a UI user in the database (the first admin; over the API: `exitplane users
    create`)."""
    from controlplane.auth.users import create_user
    from controlplane.db import session_scope
    from controlplane.errors import DomainError

    password = read_password(password_file)
    try:
        with session_scope() as session:
            created = create_user(session=session, username=username, password=password,
                                  role=role, actor="cli:bootstrap")
            name = created.username
    except DomainError as error:
        _fail(str(error))
    click.echo(f"user {name!r} created with role {role}")


# -- deprecated spellings: they keep scripts working, and say what replaces them --------------

def _deprecated(ctx: click.Context, instead: str) -> None:
    click.echo(f"exitplane: `exitplane {ctx.info_name}` is deprecated; use {instead}", err=True)


class DeprecatedGroup(click.Group):
    """A hidden group that says in one line on stderr what replaces it, then runs. A command
    it does not have is looked up in `plural`, the group that replaces it over the API
    (`exitplane token list` runs `exitplane tokens list`)."""

    def __init__(self, *args, instead: str, plural: click.Group | None = None,
                 **kwargs) -> None:
        kwargs.setdefault("help", f"Deprecated: use {instead}.")
        super().__init__(*args, hidden=True, **kwargs)
        self.instead = instead
        self.plural = plural

    def list_commands(self, ctx: click.Context) -> list[str]:
        own = super().list_commands(ctx)
        more = self.plural.list_commands(ctx) if self.plural else []
        return sorted({*own, *more})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        found = super().get_command(ctx, name)
        if found is None and self.plural is not None:
            found = self.plural.get_command(ctx, name)
        return found

    def invoke(self, ctx: click.Context):
        _deprecated(ctx, self.instead)
        return super().invoke(ctx)


class DeprecatedCommand(click.Command):
    """A hidden command that says in one line on stderr what replaces it, then runs."""

    def __init__(self, *args, instead: str, **kwargs) -> None:
        super().__init__(*args, hidden=True, **kwargs)
        self.instead = instead

    def invoke(self, ctx: click.Context):
        _deprecated(ctx, self.instead)
        return super().invoke(ctx)


token = DeprecatedGroup("token", instead="`exitplane bootstrap token` (database access) or "
                                         "`exitplane tokens` (over the API)", plural=tokens)
token.add_command(bootstrap_token, "create")
deployment = DeprecatedGroup("deployment", instead="`exitplane bootstrap deployment` "
                                                   "(database access) or `exitplane "
                                                   "deployments` (over the API)",
                             plural=deployments)
deployment.add_command(bootstrap_deployment, "ensure")
user = DeprecatedGroup("user", instead="`exitplane bootstrap user` (database access) or "
                                       "`exitplane users` (over the API)", plural=users)
user.add_command(bootstrap_user, "create")
segment = DeprecatedGroup("segment", instead="`exitplane segments` (over the API)")


def _segment_change(deployment: str, action):
    """Run `action(session, deployment)` in one transaction; a refusal ends the command."""
    from controlplane.db import session_scope
    from controlplane.deployments.service import get_deployment
    from controlplane.errors import DomainError

    try:
        with session_scope() as session:
            return action(session, get_deployment(session=session, name=deployment))
    except DomainError as error:
        _fail(str(error))


@segment.command("declare")
@click.option("--deployment", required=True, help="the deployment whose traffic it is")
@click.option("--reason", default="declared from the command line", show_default=True,
              help="why (written to the audit log)")
@click.argument("name")
def segment_declare(deployment: str, reason: str, name: str) -> None:
    """Put segment NAME in use, in the database directly (`exitplane segments declare`)."""
    from controlplane.deployments.segments import declare_segment

    _segment_change(deployment, lambda session, found: declare_segment(
        session=session, deployment=found, name=name, actor="cli:segment-declare",
        reason=reason))
    click.echo(f"segment {name!r} of {deployment!r} is in use", err=True)


@segment.command("remove")
@click.option("--deployment", required=True, help="the deployment whose traffic it is")
@click.option("--reason", default="removed from the command line", show_default=True,
              help="why (written to the audit log)")
@click.argument("name")
def segment_remove(deployment: str, reason: str, name: str) -> None:
    """Take segment NAME out of use, in the database directly (`exitplane segments
    remove`)."""
    from controlplane.deployments.segments import remove_segment

    _segment_change(deployment, lambda session, found: remove_segment(
        session=session, deployment=found, name=name, actor="cli:segment-remove",
        reason=reason))
    click.echo(f"segment {name!r} of {deployment!r} removed", err=True)


@segment.command("list")
@click.option("--deployment", required=True, help="the deployment to list")
def segment_list(deployment: str) -> None:
    """One line per segment, read from the database directly (`exitplane segments list`)."""
    from datetime import UTC, datetime, timedelta

    from controlplane.deployments.segments import segment_registry, undeclared_tokens

    def read(session, found):
        rows = [(row.name, "removed" if row.removed_at else "in use", row.origin,
                 (row.removed_at or row.created_at).isoformat(timespec="seconds"))
                for row in segment_registry(session=session, deployment_id=found.id)]
        return found.auto_segments, rows, undeclared_tokens(
            session=session, deployment=found, since=datetime.now(UTC) - timedelta(days=1))

    auto, rows, undeclared = _segment_change(deployment, read)
    for row in rows:
        click.echo("\t".join(row))
    click.echo(f"telemetry registers new names: {'yes' if auto else 'no'} (auto_segments)",
               err=True)
    for item in undeclared:
        click.echo(f"undeclared: {item['tokens']} tokens in {item['batches']} batches from "
                   f"runtime {item['runtime_id']} (last 24 h)", err=True)


def register_database_commands(main: click.Group) -> None:
    """Add `bootstrap` and the deprecated singular groups to the `exitplane` command (`db` is
    added by the caller)."""
    for command in (bootstrap, token, deployment, user, segment):
        main.add_command(command)
