"""shadow requests: whole requests served at full depth, and the answer target

`shadow_request_tokens` holds a shadow request's tokens until the request is complete (or its
tokens expire); `shadow_requests` holds each complete request with every token's labels at
every exit point (controlplane/telemetry/shadow_requests.py). `deployments` gains the answer
target `delta_answer` and the `shadow_request_rate` sent to runtimes in pulls (both NULL: none).

Revision ID: 0021_shadow_requests
Revises: 0020_admin_events
Create Date: 2026-12-05 08:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import controlplane.db

revision: str = "0021_shadow_requests"
down_revision: str | Sequence[str] | None = "0020_admin_events"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _labelled_columns() -> list[sa.Column]:
    """The columns both tables share after their keys."""
    return [
        sa.Column("ts", controlplane.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("threshold_version", sa.Integer(), nullable=False),
        sa.Column("segment", sa.String(length=64), nullable=False),
        sa.Column("witness", sa.String(length=140), nullable=False),
        sa.Column("model_revision", sa.String(length=128), nullable=False),
        sa.Column("head_digest", sa.String(length=71), nullable=False),
        sa.Column("arrival_delay_s", sa.Double(), nullable=False),
    ]


def upgrade() -> None:
    op.add_column("deployments", sa.Column("delta_answer", sa.Double(), nullable=True))
    op.add_column("deployments", sa.Column("shadow_request_rate", sa.Double(), nullable=True))
    op.create_table(
        "shadow_request_tokens",
        sa.Column("deployment_id", sa.Integer(), nullable=False),
        sa.Column("runtime_id", sa.String(length=128), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        *_labelled_columns(),
        sa.Column("request_end", sa.Boolean(), nullable=False),
        sa.Column("signals", sa.LargeBinary(), nullable=False),
        sa.Column("matched", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(["deployment_id"], ["deployments.id"],
                                name=op.f("fk_shadow_request_tokens_deployment_id_deployments"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("deployment_id", "runtime_id", "request_id", "position",
                                name=op.f("pk_shadow_request_tokens")),
    )
    op.create_index("ix_shadow_request_tokens_deployment_id_ts", "shadow_request_tokens",
                    ["deployment_id", "ts"], unique=False)
    op.create_table(
        "shadow_requests",
        sa.Column("deployment_id", sa.Integer(), nullable=False),
        sa.Column("runtime_id", sa.String(length=128), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        *_labelled_columns(),
        sa.Column("tokens", sa.Integer(), nullable=False),
        sa.Column("signals", sa.LargeBinary(), nullable=False),
        sa.Column("matched", sa.LargeBinary(), nullable=False),
        sa.Column("completed_at", controlplane.db.UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["deployment_id"], ["deployments.id"],
                                name=op.f("fk_shadow_requests_deployment_id_deployments"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("deployment_id", "runtime_id", "request_id",
                                name=op.f("pk_shadow_requests")),
    )
    op.create_index("ix_shadow_requests_deployment_id_ts", "shadow_requests",
                    ["deployment_id", "ts"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_shadow_requests_deployment_id_ts", table_name="shadow_requests")
    op.drop_table("shadow_requests")
    op.drop_index("ix_shadow_request_tokens_deployment_id_ts", table_name="shadow_request_tokens")
    op.drop_table("shadow_request_tokens")
    op.drop_column("deployments", "shadow_request_rate")
    op.drop_column("deployments", "delta_answer")
