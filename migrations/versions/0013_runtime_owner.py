"""runtimes belong to the token that registered them

`runtimes.token_id` names the token whose first heartbeat registered the runtime (NULL for
runtimes registered before, and when the token is deleted); a deployment's runtimes are
counted per token for the cap of runtimes one token may register.

Revision ID: 0013_runtime_owner
Revises: 0012_outliers
Create Date: 2026-12-03 10:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013_runtime_owner"
down_revision: str | Sequence[str] | None = "0012_outliers"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runtimes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("token_id", sa.Integer(), nullable=True))
        batch_op.create_foreign_key(batch_op.f("fk_runtimes_token_id_api_tokens"), "api_tokens",
                                    ["token_id"], ["id"], ondelete="SET NULL")
        batch_op.create_index("ix_runtimes_deployment_id_token_id",
                              ["deployment_id", "token_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("runtimes", schema=None) as batch_op:
        batch_op.drop_index("ix_runtimes_deployment_id_token_id")
        batch_op.drop_constraint(batch_op.f("fk_runtimes_token_id_api_tokens"),
                                 type_="foreignkey")
        batch_op.drop_column("token_id")
