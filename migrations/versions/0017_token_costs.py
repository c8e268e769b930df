"""rollups keep what their tokens cost

Per rollup row (minute, deployment, version, runtime, segment, layer) `timed_tokens` counts the
tokens that left at the layer and reported their cost, `latency_us` and `exit_checks` sum those
tokens' wall time (microseconds) and exit checks, and `shadow_tokens` counts the shadow tokens
among all that left there. The savings' cost model is fitted on them; rows stored before read
as untimed, with no shadow tokens counted.

Revision ID: 0017_token_costs
Revises: 0016_witnesses
Create Date: 2026-12-05 05:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017_token_costs"
down_revision: str | Sequence[str] | None = "0016_witnesses"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ("timed_tokens", "latency_us", "exit_checks", "shadow_tokens")


def upgrade() -> None:
    for name in COLUMNS:
        op.add_column("rollups", sa.Column(name, sa.BigInteger(), nullable=False,
                                           server_default="0"))


def downgrade() -> None:
    for name in reversed(COLUMNS):
        op.drop_column("rollups", name)
