"""unchecked tokens keep no signal (token_records.signal_value nullable); shadow samples carry
their request id (quality tests cluster shadow tokens by request)

A token whose exits were not checked has no signal: stored as 0 it would move the signal
histogram with batch composition. Rows stored before this migration keep their values.

Revision ID: 0006_drift
Revises: 0006_fleet
Create Date: 2026-11-30 09:15:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_drift"
down_revision: str | Sequence[str] | None = "0006_fleet"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("token_records", schema=None) as batch_op:
        batch_op.alter_column("signal_value", existing_type=sa.Double(), nullable=True)
    with op.batch_alter_table("shadow_samples", schema=None) as batch_op:
        batch_op.add_column(sa.Column("request_id", sa.String(length=128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("shadow_samples", schema=None) as batch_op:
        batch_op.drop_column("request_id")
    op.execute("UPDATE token_records SET signal_value = 0 WHERE signal_value IS NULL")
    with op.batch_alter_table("token_records", schema=None) as batch_op:
        batch_op.alter_column("signal_value", existing_type=sa.Double(), nullable=False)
