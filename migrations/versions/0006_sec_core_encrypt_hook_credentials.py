"""hook URLs, HMAC secrets and routing keys are stored encrypted

Existing rows are encrypted with the Fernet key derived from the secret key
(`controlplane.keys.vault`: EXITPLANE_SECRET_KEY, or `<var_dir>/secret_key`). On PostgreSQL
the columns become unbounded text, as the ciphertext is longer than the plaintext; SQLite does
not enforce VARCHAR lengths, so its declared types stay.

Failed deliveries logged before kept up to 500 characters of the receiver's answer or the
network error's text; they keep only their status code and a fixed reason now, as new ones.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30 09:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = (("url", 2000), ("secret", 200), ("routing_key", 200))
hooks = sa.table("alert_hooks", sa.column("id", sa.Integer),
                 *(sa.column(name, sa.Text) for name, _ in COLUMNS))


def _vault():
    from controlplane.keys import vault
    from controlplane.settings import get_settings

    return vault(get_settings())


def _rewrite(convert) -> None:
    bind = op.get_bind()
    rows = bind.execute(sa.select(hooks)).all()
    if not rows:
        return  # an empty store needs no key (nothing is generated for it)
    vault = _vault()
    for row in rows:
        values = {name: convert(vault, getattr(row, name)) for name, _ in COLUMNS}
        bind.execute(hooks.update().where(hooks.c.id == row.id).values(**values))


def _encrypt(vault, value):
    from controlplane.keys import ENCRYPTED_PREFIX

    if value is None or value.startswith(ENCRYPTED_PREFIX):
        return value
    return vault.encrypt(value)


def _decrypt(vault, value):
    from controlplane.keys import ENCRYPTED_PREFIX

    if value is None or not value.startswith(ENCRYPTED_PREFIX):
        return value
    return vault.decrypt(value)


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for name, length in COLUMNS:
            op.alter_column("alert_hooks", name, type_=sa.Text(),
                            existing_type=sa.String(length))
    _rewrite(_encrypt)
    deliveries = sa.table("alert_deliveries", sa.column("error", sa.Text),
                          sa.column("status_code", sa.Integer))
    # The reasons of controlplane.alerts.hooks at this revision, spelled out: a migration
    # must not change with later code.
    op.get_bind().execute(deliveries.update().where(deliveries.c.error.is_not(None)).values(
        error=sa.case((deliveries.c.status_code.is_(None),
                       "no answer from the destination (connection failed or timed out)"),
                      else_=sa.literal("HTTP ") + sa.cast(deliveries.c.status_code,
                                                          sa.String))))


def downgrade() -> None:
    _rewrite(_decrypt)
    if op.get_bind().dialect.name == "postgresql":
        for name, length in COLUMNS:
            op.alter_column("alert_hooks", name, type_=sa.String(length),
                            existing_type=sa.Text())
