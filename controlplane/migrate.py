"""Run Alembic programmatically (`exitplane db upgrade` and the tests use this), and tell whether
a store's schema is at the revision this release needs (readiness, `exitplane db current`)."""

from __future__ import annotations

import functools
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection

import migrations

UPGRADE_HINT = "run `exitplane db upgrade`"  # what every "schema not migrated" says to do


def alembic_config(url: str) -> Config:
    """An Alembic config pointing at the packaged migrations and at `url`."""
    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


@functools.cache
def _scripts() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config(""))


def head_revisions() -> frozenset[str]:
    """The revisions this release's migrations end in (no database needed)."""
    return frozenset(_scripts().get_heads())


def stored_revisions(connection: Connection) -> frozenset[str]:
    """The revisions the store at `connection` is at (empty: no schema yet)."""
    return frozenset(MigrationContext.configure(connection).get_current_heads())


def not_migrated(stored: frozenset[str]) -> str | None:
    """Why a store at `stored` cannot serve this release, or None when it can: no schema yet,
    or a revision this release's migrations lead on from. A revision this release does not
    know counts as current: a newer release migrated the store (the migrations run before its
    replicas roll, and a rollback leaves the schema where it is)."""
    if not stored:
        return f"schema not migrated: the store has no schema yet; {UPGRADE_HINT}"
    heads = head_revisions()
    known = {script.revision for script in _scripts().walk_revisions()}
    if stored == heads or not stored <= known:
        return None
    return (f"schema not migrated: the store is at {', '.join(sorted(stored))}, this release "
            f"needs {', '.join(sorted(heads))}; {UPGRADE_HINT}")
