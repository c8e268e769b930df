"""runtime refusals: the threshold set a runtime refuses, in the fleet view

`runtimes` gains `refused_version`: the version of the threshold set the runtime refused last,
while that refusal stands, as its heartbeats report it (`error` holds why). NULL: it refuses
none, or its client does not report refusals.

Revision ID: 0024_runtime_refusals
Revises: 0023_audit_fleet
Create Date: 2026-12-05 08:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0024_runtime_refusals"
down_revision: str | Sequence[str] | None = "0023_audit_fleet"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("runtimes", sa.Column("refused_version", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("runtimes", "refused_version")
