"""robust evidence: runtimes set aside as outliers

Revision ID: 0012_outliers
Revises: 0011_lineage
Create Date: 2026-12-03 10:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa  # noqa: F401
from alembic import op  # noqa: F401

revision: str = "0012_outliers"
down_revision: str | Sequence[str] | None = "0011_lineage"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
