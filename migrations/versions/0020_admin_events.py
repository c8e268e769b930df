"""admin events: the audit log of administrative actions

`admin_events` keeps who created or revoked a token, created a user or changed a role, created,
changed or deleted an alert hook, or acknowledged or resolved an alert, when and why
(controlplane/auth/audit.py). Deployment changes stay in `audit_events`.

Revision ID: 0020_admin_events
Revises: 0019_adaptive_shadow
Create Date: 2026-12-05 06:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import controlplane.db

revision: str = "0020_admin_events"
down_revision: str | Sequence[str] | None = "0019_adaptive_shadow"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "admin_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("actor", sa.String(length=200), nullable=False),
        sa.Column("action", sa.String(length=50), nullable=False),
        sa.Column("target", sa.String(length=200), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.Column("created_at", controlplane.db.UTCDateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_admin_events")),
    )
    op.create_index(op.f("ix_admin_events_action"), "admin_events", ["action"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_admin_events_action"), table_name="admin_events")
    op.drop_table("admin_events")
