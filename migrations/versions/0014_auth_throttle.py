"""sign-in throttles: failed password checks per throttle key, where no Redis is configured

Revision ID: 0014_auth_throttle
Revises: 0013_runtime_owner
Create Date: 2026-12-03 10:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import controlplane.db

revision: str = "0014_auth_throttle"
down_revision: str | Sequence[str] | None = "0013_runtime_owner"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "signin_failures",
        sa.Column("key", sa.String(length=40), nullable=False),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.Column("locked_until", controlplane.db.UTCDateTime(timezone=True), nullable=True),
        sa.Column("last_failure_at", controlplane.db.UTCDateTime(timezone=True),
                  nullable=False),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_signin_failures")),
    )
    op.create_index(op.f("ix_signin_failures_last_failure_at"), "signin_failures",
                    ["last_failure_at"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_signin_failures_last_failure_at"), table_name="signin_failures")
    op.drop_table("signin_failures")
