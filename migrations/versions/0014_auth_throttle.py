"""sign-in throttles

Revision ID: 0014_auth_throttle
Revises: 0013_runtime_owner
Create Date: 2026-12-03 10:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa  # noqa: F401
from alembic import op  # noqa: F401

revision: str = "0014_auth_throttle"
down_revision: str | Sequence[str] | None = "0013_runtime_owner"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
