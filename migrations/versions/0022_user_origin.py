"""user origin: how a user of the admin UI signs in

`users` gains `origin`: `local` (a password stored here, every user so far) or `sso` (provisioned
at a sign-in through an OpenID Connect provider or a trusted authenticating proxy; no password
works for them: controlplane/auth/sso.py), and `sso_subject`: the OpenID Connect provider's
issuer and subject a user is bound to at their first sign-in.

Revision ID: 0022_user_origin
Revises: 0021_shadow_requests
Create Date: 2026-12-05 08:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0022_user_origin"
down_revision: str | Sequence[str] | None = "0021_shadow_requests"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("users", sa.Column("origin", sa.String(length=20), nullable=False,
                                     server_default="local"))
    op.add_column("users", sa.Column("sso_subject", sa.String(length=600), nullable=True))


def downgrade() -> None:
    op.drop_column("users", "sso_subject")
    op.drop_column("users", "origin")
