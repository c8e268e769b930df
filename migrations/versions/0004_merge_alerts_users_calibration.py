"""merge the alerts, users and calibration branches

Revision ID: 0004
Revises: 0003_alerts, 0003_users, 0003_calibration
Create Date: 2026-11-29 10:35:00
"""

from collections.abc import Sequence

revision: str = "0004"
down_revision: tuple[str, ...] = ("0003_alerts", "0003_users", "0003_calibration")
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
