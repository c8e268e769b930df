"""batch ids scoped to their deployment; operator-declared segments

A batch id is unique within its deployment: telemetry_batches is keyed by (deployment_id,
batch_id), token_records and shadow_samples by (deployment_id, batch_id, idx, ts), so another
deployment's batch that reuses an id is stored as its own while a replay within the deployment
stays a no-op.

Segments become the operator's: `deployments.auto_segments` (off) says whether runtime
telemetry may register names nobody declared; `deployment_segments` says where a name came from
(`origin`: every row this migration finds came from traffic or a published set, and is kept
as 'telemetry') and keeps removed names (`removed_at`) so their history stays
readable. `undeclared_segment_tokens` counts, per minute and runtime, the tokens stored as
`default` because their segment was not declared.

Revision ID: 0010_batch_scope
Revises: 0009_seg_loop
Create Date: 2026-12-03 10:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import controlplane.db

revision: str = "0010_batch_scope"
down_revision: str | Sequence[str] | None = "0009_seg_loop"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ROW_TABLES = ("token_records", "shadow_samples")


def _primary_key(table: str, columns: list[str]) -> None:
    # PostgreSQL: token_records and shadow_samples are partitioned; a key on the parent (it
    # holds the partition key `ts`) reaches every partition.
    with op.batch_alter_table(table, schema=None) as batch_op:
        batch_op.drop_constraint(f"pk_{table}", type_="primary")
        batch_op.create_primary_key(f"pk_{table}", columns)


def upgrade() -> None:
    _primary_key("telemetry_batches", ["deployment_id", "batch_id"])
    for table in ROW_TABLES:
        _primary_key(table, ["deployment_id", "batch_id", "idx", "ts"])
    with op.batch_alter_table("deployments", schema=None) as batch_op:
        batch_op.add_column(sa.Column("auto_segments", sa.Boolean(), nullable=False,
                                      server_default=sa.false()))
    with op.batch_alter_table("deployment_segments", schema=None) as batch_op:
        batch_op.add_column(sa.Column("origin", sa.String(length=16), nullable=False,
                                      server_default="operator"))
        batch_op.add_column(sa.Column("removed_at", controlplane.db.UTCDateTime(timezone=True),
                                      nullable=True))
    op.execute("UPDATE deployment_segments SET origin = 'telemetry'")
    op.create_table(
        "undeclared_segment_tokens",
        sa.Column("deployment_id", sa.Integer(), nullable=False),
        sa.Column("runtime_id", sa.String(length=128), nullable=False),
        sa.Column("minute", controlplane.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("batches", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("deployment_id", "runtime_id", "minute",
                                name=op.f("pk_undeclared_segment_tokens")),
    )


def downgrade() -> None:
    op.drop_table("undeclared_segment_tokens")
    # A removed segment was never removable before: it is dropped with its marker.
    op.execute("DELETE FROM deployment_segments WHERE removed_at IS NOT NULL")
    with op.batch_alter_table("deployment_segments", schema=None) as batch_op:
        batch_op.drop_column("removed_at")
        batch_op.drop_column("origin")
    with op.batch_alter_table("deployments", schema=None) as batch_op:
        batch_op.drop_column("auto_segments")
    # One id per store again: of the batches that share an id, the oldest deployment's stays
    # (with its rows); the others' rows go, as a global id would have refused them.
    op.execute("DELETE FROM telemetry_batches WHERE EXISTS (SELECT 1 FROM telemetry_batches "
               "AS first WHERE first.batch_id = telemetry_batches.batch_id "
               "AND first.deployment_id < telemetry_batches.deployment_id)")
    for table in ROW_TABLES:
        op.execute(f"DELETE FROM {table} WHERE EXISTS (SELECT 1 FROM {table} AS first "
                   f"WHERE first.batch_id = {table}.batch_id "
                   f"AND first.deployment_id < {table}.deployment_id)")
        _primary_key(table, ["batch_id", "idx", "ts"])
    _primary_key("telemetry_batches", ["batch_id"])
