"""operating curves, and re-tuning on a schedule

`operating_curves` keeps each deployment's latest operating curve per traffic segment (one row
per deployment and segment): the window it was drawn from, its evidence counts, the points of
the frontier, the sets marked on it, the best certified set, the gap to the active set and the
opportunity verdict. `deployments.retune_every_s` (NULL: off) makes a deployment recalibrate
on a schedule.

Revision ID: 0018_operating_curves
Revises: 0017_token_costs
Create Date: 2026-12-05 05:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import controlplane.db

revision: str = "0018_operating_curves"
down_revision: str | Sequence[str] | None = "0017_token_costs"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "operating_curves",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("deployment_id", sa.Integer(), nullable=False),
        sa.Column("segment", sa.String(length=64), nullable=False),
        sa.Column("computed_at", controlplane.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("window_since", controlplane.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("window_until", controlplane.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("evidence", sa.JSON(), nullable=False),
        sa.Column("points", sa.JSON(), nullable=False),
        sa.Column("marks", sa.JSON(), nullable=False),
        sa.Column("best", sa.JSON(), nullable=True),
        sa.Column("gap", sa.JSON(), nullable=True),
        sa.Column("opportunity", sa.JSON(), nullable=True),
        sa.ForeignKeyConstraint(["deployment_id"], ["deployments.id"],
                                name=op.f("fk_operating_curves_deployment_id_deployments"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_operating_curves")),
        sa.UniqueConstraint("deployment_id", "segment",
                            name=op.f("uq_operating_curves_deployment_id")),
    )
    op.add_column("deployments", sa.Column("retune_every_s", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("deployments", "retune_every_s")
    op.drop_table("operating_curves")
