"""evidence is attributed to the credential that sent it

`shadow_samples.arrival_delay_s` keeps how long after its own timestamp each shadow token was
stored (NULL for those stored before): evidence timed implausibly long before it arrived does
not count. `shadow_samples.witness` names the witness of each shadow token: `token:<id>` for the runtime
token that posted it, `runtime:<id>` where no token was involved (a service-level writer);
'' for samples stored before witnesses were recorded, read as their runtime id.
`telemetry_batches.token_id` keeps the token that posted each batch, and
`runtime_outliers.witness` the witness an outlier record sets aside (every runtime id of that
credential with it).

Revision ID: 0016_witnesses
Revises: 0015_stored_reports
Create Date: 2026-12-04 21:50:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016_witnesses"
down_revision: str | Sequence[str] | None = "0015_stored_reports"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("shadow_samples", sa.Column("witness", sa.String(length=140), nullable=False,
                                              server_default=""))
    op.add_column("shadow_samples", sa.Column("arrival_delay_s", sa.Double(), nullable=True))
    with op.batch_alter_table("telemetry_batches", schema=None) as batch_op:
        batch_op.add_column(sa.Column("token_id", sa.Integer(), nullable=True))
    with op.batch_alter_table("runtime_outliers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("witness", sa.String(length=140), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runtime_outliers", schema=None) as batch_op:
        batch_op.drop_column("witness")
    with op.batch_alter_table("telemetry_batches", schema=None) as batch_op:
        batch_op.drop_column("token_id")
    op.drop_column("shadow_samples", "arrival_delay_s")
    op.drop_column("shadow_samples", "witness")
