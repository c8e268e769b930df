"""batch ids scoped to their deployment; operator-declared segments

Revision ID: 0010_batch_scope
Revises: 0009_seg_loop
Create Date: 2026-12-03 10:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa  # noqa: F401
from alembic import op  # noqa: F401

revision: str = "0010_batch_scope"
down_revision: str | Sequence[str] | None = "0009_seg_loop"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
