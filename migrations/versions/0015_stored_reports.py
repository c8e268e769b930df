"""alert reports in the database: every API replica serves them, whatever disk wrote them

`alert_reports` holds each alert's Evidently HTML (gzip-compressed) keyed by the alert;
`alerts.has_report` says whether one is stored and replaces `alerts.report_path`, a path on
the writing worker's disk. Reports that lived on such a disk are not carried over: the next
drift check renders a new one for an open distribution alert.

Revision ID: 0015_stored_reports
Revises: 0014_auth_throttle
Create Date: 2026-12-03 13:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import controlplane.db

revision: str = "0015_stored_reports"
down_revision: str | Sequence[str] | None = "0014_auth_throttle"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "alert_reports",
        sa.Column("alert_id", sa.Integer(), nullable=False),
        sa.Column("html_gzip", sa.LargeBinary(), nullable=False),
        sa.Column("html_bytes", sa.Integer(), nullable=False),
        sa.Column("created_at", controlplane.db.UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["alert_id"], ["alerts.id"],
                                name=op.f("fk_alert_reports_alert_id_alerts"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("alert_id", name=op.f("pk_alert_reports")),
    )
    op.create_index(op.f("ix_alert_reports_created_at"), "alert_reports", ["created_at"],
                    unique=False)
    op.add_column("alerts", sa.Column("has_report", sa.Boolean(), nullable=False,
                                      server_default=sa.false()))
    # A plain ALTER TABLE (SQLite >= 3.35 too): a batch rebuild of `alerts` on SQLite would
    # cascade-delete the rows that reference it.
    op.drop_column("alerts", "report_path")


def downgrade() -> None:
    op.add_column("alerts", sa.Column("report_path", sa.String(length=500), nullable=True))
    op.drop_column("alerts", "has_report")
    op.drop_index(op.f("ix_alert_reports_created_at"), table_name="alert_reports")
    op.drop_table("alert_reports")
