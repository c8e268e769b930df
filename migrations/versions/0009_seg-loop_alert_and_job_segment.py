"""alerts and calibration jobs name their traffic segment (the per-segment loop)

`alerts.segment`: the segment whose traffic the condition was observed on; 'default' for every
existing alert (and for alerts about the whole deployment: stale runtimes, canaries).
`calibration_jobs.segment`: the one segment a recalibration runs on (its shadow tokens only,
replacing only its map); NULL for a whole-deployment calibration, as every existing job was.

Revision ID: 0009_seg_loop
Revises: 0008_segment_traffic
Create Date: 2026-11-30 15:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009_seg_loop"
down_revision: str | Sequence[str] | None = "0008_segment_traffic"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("alerts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("segment", sa.String(length=64), nullable=False,
                                      server_default="default"))
    with op.batch_alter_table("calibration_jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("segment", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("calibration_jobs", schema=None) as batch_op:
        batch_op.drop_column("segment")
    with op.batch_alter_table("alerts", schema=None) as batch_op:
        batch_op.drop_column("segment")
