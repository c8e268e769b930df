"""runtimes belong to the token that registered them

Revision ID: 0013_runtime_owner
Revises: 0012_outliers
Create Date: 2026-12-03 10:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa  # noqa: F401
from alembic import op  # noqa: F401

revision: str = "0013_runtime_owner"
down_revision: str | Sequence[str] | None = "0012_outliers"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
