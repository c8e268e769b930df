"""rollup tables keep free space on each page (PostgreSQL fillfactor 70)

Every telemetry batch adds onto the rows of its minutes: with free space on the page the
update is a heap-only tuple (no index write, no new page). No effect on SQLite.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-29 13:30:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("rollups", "rollup_histograms")


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for table in TABLES:
            op.execute(f"ALTER TABLE {table} SET (fillfactor = 70)")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for table in TABLES:
            op.execute(f"ALTER TABLE {table} RESET (fillfactor)")
