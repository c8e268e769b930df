"""lineage: the model revision and exit-heads digest a deployment serves and each runtime reports

`deployments.model_revision` ('' names none) joins the existing `head_digest`;
`threshold_sets.head_digest` names the heads a set was made for (NULL: any heads, which every
existing set keeps, so its checksum stays what it was); `runtimes` keeps what each runtime's
last heartbeat said it serves and when and what it last reported that differed from its
deployment's (controlplane/runtimes/lineage.py).

Revision ID: 0011_lineage
Revises: 0010_batch_scope
Create Date: 2026-12-03 10:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import controlplane.db

revision: str = "0011_lineage"
down_revision: str | Sequence[str] | None = "0010_batch_scope"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


RUNTIME_COLUMNS = ("model_revision", "head_digest", "lineage_mismatch_at",
                   "mismatch_model_revision", "mismatch_head_digest")


def upgrade() -> None:
    op.add_column("deployments", sa.Column("model_revision", sa.String(length=128),
                                           nullable=False, server_default=""))
    op.add_column("threshold_sets", sa.Column("head_digest", sa.String(length=71),
                                              nullable=True))
    op.add_column("runtimes", sa.Column("model_revision", sa.String(length=128), nullable=True))
    op.add_column("runtimes", sa.Column("head_digest", sa.String(length=71), nullable=True))
    op.add_column("runtimes", sa.Column("lineage_mismatch_at",
                                        controlplane.db.UTCDateTime(timezone=True),
                                        nullable=True))
    op.add_column("runtimes", sa.Column("mismatch_model_revision", sa.String(length=128),
                                        nullable=True))
    op.add_column("runtimes", sa.Column("mismatch_head_digest", sa.String(length=71),
                                        nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runtimes", schema=None) as batch_op:
        for column in reversed(RUNTIME_COLUMNS):
            batch_op.drop_column(column)
    with op.batch_alter_table("threshold_sets", schema=None) as batch_op:
        batch_op.drop_column("head_digest")
    with op.batch_alter_table("deployments", schema=None) as batch_op:
        batch_op.drop_column("model_revision")
