"""robust evidence: runtimes set aside as outliers

`runtime_outliers`: a runtime whose shadow evidence differed from the rest of its fleet beyond
chance, set aside (its samples feed no calibration, drift test or canary verdict) until an
operator clears it; `open_runtime` (NULL once cleared) keeps one open record per runtime.

Revision ID: 0012_outliers
Revises: 0011_lineage
Create Date: 2026-12-03 10:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import controlplane.db

revision: str = "0012_outliers"
down_revision: str | Sequence[str] | None = "0011_lineage"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "runtime_outliers",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("deployment_id", sa.Integer(), nullable=False),
        sa.Column("runtime_id", sa.String(length=128), nullable=False),
        sa.Column("open_runtime", sa.String(length=128), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("segment", sa.String(length=64), nullable=False),
        sa.Column("summary", sa.Text(), nullable=False),
        sa.Column("evidence", sa.JSON(), nullable=False),
        sa.Column("alert_id", sa.Integer(), nullable=True),
        sa.Column("detected_at", controlplane.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("cleared_at", controlplane.db.UTCDateTime(timezone=True), nullable=True),
        sa.Column("cleared_by", sa.String(length=200), nullable=True),
        sa.Column("clear_reason", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["alert_id"], ["alerts.id"],
                                name=op.f("fk_runtime_outliers_alert_id_alerts"),
                                ondelete="SET NULL"),
        sa.ForeignKeyConstraint(["deployment_id"], ["deployments.id"],
                                name=op.f("fk_runtime_outliers_deployment_id_deployments"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runtime_outliers")),
        sa.UniqueConstraint("deployment_id", "open_runtime",
                            name=op.f("uq_runtime_outliers_deployment_id")),
    )
    with op.batch_alter_table("runtime_outliers", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_runtime_outliers_deployment_id"),
                              ["deployment_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("runtime_outliers", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_runtime_outliers_deployment_id"))
    op.drop_table("runtime_outliers")
