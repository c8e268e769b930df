"""coordination epochs: one counter per notification topic (revocation), for API processes
that run without Redis

Revision ID: 0006_replicas
Revises: 0006
Create Date: 2026-11-30 09:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_replicas"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    table = op.create_table(
        "coordination_epochs",
        sa.Column("topic", sa.String(length=64), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("topic", name=op.f("pk_coordination_epochs")))
    op.bulk_insert(table, [{"topic": "revocation", "epoch": 0}])


def downgrade() -> None:
    op.drop_table("coordination_epochs")
