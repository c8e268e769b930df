"""telemetry batches say what they carried: records, sampled records or aggregates

`kind` is 'records' (every token as a record: today's batches), 'sampled' (records of a runtime
that aggregates at the edge: shadow tokens and a sample of the rest) or 'aggregate' (exact
per-minute counts); `tokens` is how many tokens the batch accounts for in the rollups and
`raw_sample_rate` the share of non-shadow tokens an aggregating runtime ships as records.

Revision ID: 0006_fleet
Revises: 0006_replicas
Create Date: 2026-11-30 09:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_fleet"
down_revision: str | Sequence[str] | None = "0006_replicas"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("telemetry_batches", schema=None) as batch_op:
        batch_op.add_column(sa.Column("kind", sa.String(length=16), nullable=False,
                                      server_default="records"))
        batch_op.add_column(sa.Column("tokens", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("raw_sample_rate", sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("telemetry_batches", schema=None) as batch_op:
        batch_op.drop_column("raw_sample_rate")
        batch_op.drop_column("tokens")
        batch_op.drop_column("kind")
