"""Alembic environment: the URL comes from settings unless the caller passes one."""

from __future__ import annotations

from alembic import context

from controlplane.db import make_engine
from controlplane.models import Base
from controlplane.settings import get_settings
from controlplane.telemetry.models import is_partition

config = context.config
target_metadata = Base.metadata


def include_name(name, type_, parent_names) -> bool:
    return not (type_ == "table" and is_partition(name))


def run_migrations() -> None:
    url = config.get_main_option("sqlalchemy.url") or get_settings().effective_database_url
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            _run(connection)
    finally:
        engine.dispose()


def _run(connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata,
                      render_as_batch=connection.dialect.name == "sqlite",
                      compare_type=True, include_name=include_name)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    """Write the migrations' SQL instead of running it (`exitplane db upgrade --sql`)."""
    url = config.get_main_option("sqlalchemy.url") or get_settings().effective_database_url
    context.configure(url=url, target_metadata=target_metadata, literal_binds=True,
                      render_as_batch=url.startswith("sqlite"), include_name=include_name,
                      dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations()
