"""(reserved: filled in by the change that needs it)

Revision ID: 0017_token_costs
Revises: 0016_witnesses
Create Date: 2026-12-05 05:00:00
"""

from collections.abc import Sequence

revision: str = "0017_token_costs"
down_revision: str | Sequence[str] | None = "0016_witnesses"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
