"""evidence is attributed to the credential that sent it

`shadow_samples.arrival_delay_s` keeps how long after its own timestamp each shadow token was
stored (NULL for those stored before): evidence timed implausibly long before it arrived does
not count. `shadow_samples.witness` names the witness of each shadow token: `token:<id>` for the runtime
token that posted it, `runtime:<id>` where no token was involved (a service-level writer);
'' for samples stored before witnesses were recorded, read as their runtime id.
`telemetry_batches.token_id` keeps the token that posted each batch, and
`runtime_outliers.witness` the witness an outlier record sets aside (every runtime id of that
credential with it). `runtime_versions` keeps the threshold versions each runtime's heartbeats
said it applied: a token's shadow tokens stamped with another version do not count.

Revision ID: 0016_witnesses
Revises: 0015_stored_reports
Create Date: 2026-12-04 21:50:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import controlplane.db

revision: str = "0016_witnesses"
down_revision: str | Sequence[str] | None = "0015_stored_reports"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("shadow_samples", sa.Column("witness", sa.String(length=140), nullable=False,
                                              server_default=""))
    op.add_column("shadow_samples", sa.Column("arrival_delay_s", sa.Double(), nullable=True))
    op.add_column("telemetry_batches", sa.Column("token_id", sa.Integer(), nullable=True))
    op.add_column("runtime_outliers", sa.Column("witness", sa.String(length=140),
                                                nullable=True))
    op.create_table(
        "runtime_versions",
        sa.Column("deployment_id", sa.Integer(), nullable=False),
        sa.Column("runtime_id", sa.String(length=128), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("first_at", controlplane.db.UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["deployment_id"], ["deployments.id"],
                                name=op.f("fk_runtime_versions_deployment_id_deployments"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("deployment_id", "runtime_id", "version",
                                name=op.f("pk_runtime_versions")),
    )


def downgrade() -> None:
    op.drop_table("runtime_versions")
    op.drop_column("runtime_outliers", "witness")
    op.drop_column("telemetry_batches", "token_id")
    op.drop_column("shadow_samples", "arrival_delay_s")
    op.drop_column("shadow_samples", "witness")
