"""lineage: the model revision and exit-heads digest a deployment serves and each runtime reports

Revision ID: 0011_lineage
Revises: 0010_batch_scope
Create Date: 2026-12-03 10:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa  # noqa: F401
from alembic import op  # noqa: F401

revision: str = "0011_lineage"
down_revision: str | Sequence[str] | None = "0010_batch_scope"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
