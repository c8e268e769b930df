"""audit fleet: the fleet-wide audit log's indexes and an administrative event's deployment

The fleet-wide audit log (controlplane/deployments/audit.py) reads `audit_events` and
`admin_events` newest first, together: each table gets an index on (created_at, id), the
order and the keyset its pages follow. An administrative event names the deployment it
concerns (a runtime token's, an alert's, a hook's), so a filter on one deployment finds it.

Revision ID: 0023_audit_fleet
Revises: 0022_user_origin
Create Date: 2026-12-05 08:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0023_audit_fleet"
down_revision: str | Sequence[str] | None = "0022_user_origin"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("admin_events", sa.Column("deployment", sa.String(length=63), nullable=True))
    op.create_index(op.f("ix_admin_events_deployment"), "admin_events", ["deployment"],
                    unique=False)
    op.create_index("ix_admin_events_created_at_id", "admin_events", ["created_at", "id"],
                    unique=False)
    op.create_index("ix_audit_events_created_at_id", "audit_events", ["created_at", "id"],
                    unique=False)


def downgrade() -> None:
    op.drop_index("ix_audit_events_created_at_id", table_name="audit_events")
    op.drop_index("ix_admin_events_created_at_id", table_name="admin_events")
    op.drop_index(op.f("ix_admin_events_deployment"), table_name="admin_events")
    op.drop_column("admin_events", "deployment")
