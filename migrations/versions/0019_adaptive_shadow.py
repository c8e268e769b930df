"""adaptive shadow: the shadow rate a deployment's runtimes apply is the control plane's to set

`deployments` gains the operator's bounds on it (`shadow_rate_min`, `shadow_rate_max`; equal
bounds fix the rate) and what the control plane decided within them: `shadow_rate` (NULL:
nothing decided yet, runtimes apply their own rate), `shadow_rate_reason` and
`shadow_rate_decided_at` (controlplane/deployments/shadow_rate.py).

Revision ID: 0019_adaptive_shadow
Revises: 0018_operating_curves
Create Date: 2026-12-05 05:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import controlplane.db

revision: str = "0019_adaptive_shadow"
down_revision: str | Sequence[str] | None = "0018_operating_curves"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ("shadow_rate_min", "shadow_rate_max", "shadow_rate", "shadow_rate_reason",
           "shadow_rate_decided_at")


def upgrade() -> None:
    op.add_column("deployments", sa.Column("shadow_rate_min", sa.Double(), nullable=False,
                                           server_default="0.01"))
    op.add_column("deployments", sa.Column("shadow_rate_max", sa.Double(), nullable=False,
                                           server_default="0.2"))
    op.add_column("deployments", sa.Column("shadow_rate", sa.Double(), nullable=True))
    op.add_column("deployments", sa.Column("shadow_rate_reason", sa.Text(), nullable=False,
                                           server_default=""))
    op.add_column("deployments", sa.Column("shadow_rate_decided_at",
                                           controlplane.db.UTCDateTime(timezone=True),
                                           nullable=True))


def downgrade() -> None:
    for column in reversed(COLUMNS):
        op.drop_column("deployments", column)
