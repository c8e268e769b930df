"""threshold sets carry per-segment thresholds

`segments` is {"<segment>": {"<exit layer>": threshold}} for the traffic segments that have
thresholds of their own; NULL (every existing row) means the set has none and every segment
applies `thresholds`, the `default` segment's map.

Revision ID: 0007_segments
Revises: 0006_drift
Create Date: 2026-11-30 12:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007_segments"
down_revision: str | Sequence[str] | None = "0006_drift"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("threshold_sets", schema=None) as batch_op:
        batch_op.add_column(sa.Column("segments", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("threshold_sets", schema=None) as batch_op:
        batch_op.drop_column("segments")
