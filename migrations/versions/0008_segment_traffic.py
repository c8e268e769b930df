"""traffic carries its segment: records, shadow samples and rollups keyed by segment

Every existing row is 'default' traffic. The rollup keys gain `segment` (before `layer`), so
per-segment counts add up independently and every existing read that sums over rows still
sums the same. `deployment_segments` registers the segments a deployment knows, which caps the
label's cardinality (EXITPLANE_MAX_SEGMENTS_PER_DEPLOYMENT).

Revision ID: 0008_segment_traffic
Revises: 0007_segments
Create Date: 2026-11-30 15:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import controlplane.db

revision: str = "0008_segment_traffic"
down_revision: str | Sequence[str] | None = "0007_segments"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ROLLUP_KEYS = {"rollups": ["deployment_id", "version", "runtime_id", "minute", "layer"],
               "rollup_histograms": ["deployment_id", "version", "runtime_id", "minute", "layer",
                                     "bin"]}


def _segment(primary_key: bool = False) -> sa.Column:
    return sa.Column("segment", sa.String(length=64), nullable=False, server_default="default",
                     primary_key=primary_key)


def upgrade() -> None:
    op.create_table(
        "deployment_segments",
        sa.Column("deployment_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("created_at", controlplane.db.UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["deployment_id"], ["deployments.id"],
                                name=op.f("fk_deployment_segments_deployment_id_deployments"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("deployment_id", "name", name=op.f("pk_deployment_segments")),
    )
    # Partitioned on PostgreSQL: a column added to the parent reaches every partition.
    for table in ("token_records", "shadow_samples"):
        op.add_column(table, _segment())
    for table, keys in ROLLUP_KEYS.items():
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(_segment())
            batch_op.drop_constraint(f"pk_{table}", type_="primary")
            batch_op.create_primary_key(f"pk_{table}", [*keys[:4], "segment", *keys[4:]])


def downgrade() -> None:
    # One key per (.., layer) again: each row's counts are the sum over its segments.
    for table, keys in ROLLUP_KEYS.items():
        counters = ("tokens", "exits", "shadow_total", "shadow_matches", "policy_exits",
                    "policy_mismatches") if table == "rollups" else ("count",)
        columns = ", ".join([*keys, *counters])
        sums = ", ".join([*keys, *(f"SUM({name}) AS {name}" for name in counters)])
        op.execute(f"CREATE TABLE {table}_folded AS SELECT {sums} FROM {table} "
                   f"GROUP BY {', '.join(keys)}")
        op.execute(f"DELETE FROM {table}")
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_constraint(f"pk_{table}", type_="primary")
            batch_op.drop_column("segment")
            batch_op.create_primary_key(f"pk_{table}", keys)
        op.execute(f"INSERT INTO {table} ({columns}) SELECT {columns} FROM {table}_folded")
        op.execute(f"DROP TABLE {table}_folded")
    for table in ("token_records", "shadow_samples"):
        op.drop_column(table, "segment")
    op.drop_table("deployment_segments")
