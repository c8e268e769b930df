"""The `exitplane` command: control plane, database, tokens, and (lazily) the runtime."""

from __future__ import annotations

import importlib
import os
import sys

import click


class LazyGroup(click.Group):
    """A group whose commands live in a module imported only when used (torch is heavy)."""

    def __init__(self, *args, target: str, extra: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._target = target
        self._extra = extra

    def _load(self) -> click.Group:
        module_name, _, attribute = self._target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise click.ClickException(
                f"{error}; install the extra with: pip install 'exitplane[{self._extra}]'"
            ) from error
        return getattr(module, attribute)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return self._load().list_commands(ctx)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        return self._load().get_command(ctx, name)


def _fail(message: str, code: int = 2) -> None:
    click.echo(f"exitplane: {message}", err=True)
    sys.exit(code)


@click.group()
def main() -> None:
    """exitplane: control plane for early-exit language models."""


main.add_command(LazyGroup("runtime", target="runtime.cli:runtime_cli", extra="runtime",
                           help="Early-exit runtime: generate, train heads, benchmark."))


@main.group()
def db() -> None:
    """Database schema (Alembic is the only way it changes)."""


@db.command("upgrade")
@click.option("--revision", default="heads", show_default=True)
def db_upgrade(revision: str) -> None:
    """Apply migrations to the configured database."""
    from controlplane.migrate import upgrade
    from controlplane.settings import get_settings

    url = get_settings().effective_database_url
    upgrade(url, revision)
    click.echo(f"database at {_redact(url)} is at {revision}")


@main.group()
def token() -> None:
    """API tokens."""


@token.command("create")
@click.option("--name", required=True, help="who or what holds the token")
@click.option("--scope", type=click.Choice(["runtime", "operator", "admin"]), required=True)
@click.option("--deployment", default=None, help="the deployment a runtime token serves")
def token_create(name: str, scope: str, deployment: str | None) -> None:
    """Create a token and print it once."""
    from controlplane.auth.service import create_token
    from controlplane.db import session_scope
    from controlplane.errors import DomainError
    from controlplane.thresholds.service import get_deployment

    try:
        with session_scope() as session:
            target = get_deployment(session=session, name=deployment) if deployment else None
            _, secret = create_token(session=session, name=name, scope=scope, deployment=target)
    except DomainError as error:
        _fail(str(error))
    click.echo(secret)


@main.group()
def user() -> None:
    """People who sign in to the admin UI (/ui)."""


@user.command("create")
@click.option("--username", required=True)
@click.option("--role", type=click.Choice(["viewer", "operator", "admin"]), required=True)
@click.option("--password-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="read the password from this file (default: prompt)")
def user_create(username: str, role: str, password_file: str | None) -> None:
    """Create a UI user with a role: viewers read, operators act, admins manage."""
    from pathlib import Path

    from controlplane.auth.users import create_user
    from controlplane.db import session_scope
    from controlplane.errors import DomainError

    if password_file:
        password = Path(password_file).read_text().rstrip("\r\n")
    else:
        password = click.prompt("password", hide_input=True, confirmation_prompt=True)
    try:
        with session_scope() as session:
            created = create_user(session=session, username=username, password=password,
                                  role=role)
            name = created.username
    except DomainError as error:
        _fail(str(error))
    click.echo(f"user {name!r} created with role {role}")


@main.command()
@click.option("--host", default=None, help="default: EXITPLANE_HOST or 127.0.0.1")
@click.option("--port", type=int, default=None, help="default: EXITPLANE_PORT or 8000")
@click.option("--migrate/--no-migrate", default=True, show_default=True)
def up(host: str | None, port: int | None, migrate: bool) -> None:
    """Run the control plane API (migrating the database first)."""
    serve_api(host=host, port=port, migrate=migrate)


@main.command()
@click.option("--host", default=None)
@click.option("--port", type=int, default=None)
def demo(host: str | None, port: int | None) -> None:
    """Start the control plane on the embedded default with an admin token under var/."""
    from controlplane.settings import get_settings

    settings = get_settings()
    _migrate(settings.effective_database_url)
    token_file = settings.var_dir / "admin.token"
    if not token_file.exists():
        from controlplane.auth.service import create_token
        from controlplane.db import session_scope

        with session_scope() as session:
            _, secret = create_token(session=session, name="demo-admin", scope="admin")
        token_file.parent.mkdir(parents=True, exist_ok=True)
        token_file.write_text(secret + "\n")
        token_file.chmod(0o600)
    click.echo(f"admin token: {token_file} (use: -H \"Authorization: Bearer $(cat {token_file})\")")
    serve_api(host=host, port=port, migrate=False)


@main.command()
@click.option("--name", default=None, help="consumer name (default: host-pid)")
@click.option("--claim-idle-ms", default=30_000, show_default=True,
              help="reclaim entries another consumer left pending this long")
def ingest(name: str | None, claim_idle_ms: int) -> None:
    """Production ingest worker: Redis stream -> store (needs EXITPLANE_REDIS_URL)."""
    import logging
    import signal
    import socket
    import threading

    import redis

    from controlplane.db import session_factory
    from controlplane.settings import get_settings
    from controlplane.telemetry.service import ensure_partitions
    from controlplane.telemetry.stream import StreamIngestor

    settings = get_settings()
    if not settings.redis_url:
        _fail("EXITPLANE_REDIS_URL is not set; the embedded default writes telemetry directly")
    logging.basicConfig(level=settings.log_level.upper())
    factory = session_factory()
    with factory() as session:
        ensure_partitions(session=session)
        session.commit()
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    consumer = StreamIngestor(redis.Redis.from_url(settings.redis_url), factory,
                              name=name or f"{socket.gethostname()}-{os.getpid()}",
                              claim_idle_ms=claim_idle_ms)
    click.echo(f"ingest worker {consumer.name} reading telemetry streams", err=True)
    consumer.run_forever(stop)


def serve_api(*, host: str | None, port: int | None, migrate: bool) -> None:
    import uvicorn

    from controlplane.app import create_app
    from controlplane.settings import get_settings

    settings = get_settings()
    if migrate:
        _migrate(settings.effective_database_url)
    host = host or settings.host
    port = port or settings.port
    click.echo(f"exitplane control plane listening on http://{host}:{port} "
               f"(API docs: http://{host}:{port}/docs; store: "
               f"{_redact(settings.effective_database_url)})", err=True)
    uvicorn.run(create_app(settings), host=host, port=port, log_level=settings.log_level,
                access_log=os.environ.get("EXITPLANE_ACCESS_LOG", "0") == "1")


def _migrate(url: str) -> None:
    from controlplane.migrate import upgrade

    upgrade(url)


def _redact(url: str) -> str:
    """Hide the password in a database URL."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


if __name__ == "__main__":
    main()
