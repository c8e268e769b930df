"""alerts, alert hooks and the delivery log

Revision ID: 0003_alerts
Revises: 0002
Create Date: 2026-11-29 09:47:37.834319
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import controlplane.db

revision: str = '0003_alerts'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('alert_hooks',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('deployment_id', sa.Integer(), nullable=True),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('kind', sa.String(length=20), nullable=False),
    sa.Column('url', sa.String(length=2000), nullable=False),
    sa.Column('secret', sa.String(length=200), nullable=True),
    sa.Column('routing_key', sa.String(length=200), nullable=True),
    sa.Column('min_severity', sa.String(length=16), nullable=False),
    sa.Column('enabled', sa.Boolean(), nullable=False),
    sa.Column('created_by', sa.String(length=200), nullable=False),
    sa.Column('created_at', controlplane.db.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['deployment_id'], ['deployments.id'], name=op.f('fk_alert_hooks_deployment_id_deployments'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_alert_hooks'))
    )
    with op.batch_alter_table('alert_hooks', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_alert_hooks_deployment_id'), ['deployment_id'], unique=False)

    op.create_table('alerts',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('deployment_id', sa.Integer(), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('layer', sa.Integer(), nullable=True),
    sa.Column('severity', sa.String(length=16), nullable=False),
    sa.Column('dedup_key', sa.String(length=255), nullable=False),
    sa.Column('open_key', sa.String(length=255), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('summary', sa.Text(), nullable=False),
    sa.Column('evidence', sa.JSON(), nullable=False),
    sa.Column('report_path', sa.String(length=500), nullable=True),
    sa.Column('action_taken', sa.Text(), nullable=False),
    sa.Column('fired_at', controlplane.db.UTCDateTime(timezone=True), nullable=False),
    sa.Column('last_seen_at', controlplane.db.UTCDateTime(timezone=True), nullable=False),
    sa.Column('clear_since', controlplane.db.UTCDateTime(timezone=True), nullable=True),
    sa.Column('acknowledged_at', controlplane.db.UTCDateTime(timezone=True), nullable=True),
    sa.Column('acknowledged_by', sa.String(length=200), nullable=True),
    sa.Column('resolved_at', controlplane.db.UTCDateTime(timezone=True), nullable=True),
    sa.Column('resolved_by', sa.String(length=200), nullable=True),
    sa.Column('resolution', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['deployment_id'], ['deployments.id'], name=op.f('fk_alerts_deployment_id_deployments'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_alerts')),
    sa.UniqueConstraint('deployment_id', 'open_key', name=op.f('uq_alerts_deployment_id'))
    )
    with op.batch_alter_table('alerts', schema=None) as batch_op:
        batch_op.create_index('ix_alerts_deployment_id_id', ['deployment_id', 'id'], unique=False)
        batch_op.create_index(batch_op.f('ix_alerts_status'), ['status'], unique=False)

    op.create_table('alert_deliveries',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('hook_id', sa.Integer(), nullable=False),
    sa.Column('alert_id', sa.Integer(), nullable=True),
    sa.Column('event', sa.String(length=20), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('ok', sa.Boolean(), nullable=False),
    sa.Column('status_code', sa.Integer(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('duration_ms', sa.Double(), nullable=False),
    sa.Column('created_at', controlplane.db.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['alert_id'], ['alerts.id'], name=op.f('fk_alert_deliveries_alert_id_alerts'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['hook_id'], ['alert_hooks.id'], name=op.f('fk_alert_deliveries_hook_id_alert_hooks'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_alert_deliveries'))
    )
    with op.batch_alter_table('alert_deliveries', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_alert_deliveries_alert_id'), ['alert_id'], unique=False)
        batch_op.create_index('ix_alert_deliveries_hook_id_id', ['hook_id', 'id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('alert_deliveries', schema=None) as batch_op:
        batch_op.drop_index('ix_alert_deliveries_hook_id_id')
        batch_op.drop_index(batch_op.f('ix_alert_deliveries_alert_id'))

    op.drop_table('alert_deliveries')
    with op.batch_alter_table('alerts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_alerts_status'))
        batch_op.drop_index('ix_alerts_deployment_id_id')

    op.drop_table('alerts')
    with op.batch_alter_table('alert_hooks', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_alert_hooks_deployment_id'))

    op.drop_table('alert_hooks')
