"""Alembic is the only way the schema changes: the models and the migrations must agree."""

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text

from controlplane.migrate import downgrade, upgrade
from controlplane.models import Base
from controlplane.telemetry.models import is_partition


def test_models_match_migrations(engine):
    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={
            "compare_type": True,
            "include_name": lambda name, type_, _parents: not (type_ == "table"
                                                              and is_partition(name))})
        diff = compare_metadata(context, Base.metadata)
    assert diff == []


def test_downgrade_and_upgrade_round_trip(db_url, engine):
    downgrade(db_url, "base")
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    upgrade(db_url)
    assert set(inspect(engine).get_table_names()) >= {t.name for t in Base.metadata.sorted_tables}


@pytest.mark.postgres
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # a PostgreSQL setting
def test_rollup_tables_leave_room_for_in_place_updates(engine):
    with engine.connect() as connection:
        options = dict(connection.execute(text(
            "SELECT relname, reloptions FROM pg_class "
            "WHERE relname IN ('rollups', 'rollup_histograms')")).all())
    assert options == {"rollups": ["fillfactor=70"], "rollup_histograms": ["fillfactor=70"]}
