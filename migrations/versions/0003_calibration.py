"""calibration jobs and canary runs

Revision ID: 0003_calibration
Revises: 0002
Create Date: 2026-11-29 10:05:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import controlplane.db

revision: str = '0003_calibration'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('calibration_jobs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('deployment_id', sa.Integer(), nullable=False),
    sa.Column('trigger', sa.String(length=20), nullable=False),
    sa.Column('alert_id', sa.Integer(), nullable=True),
    sa.Column('requested_by', sa.String(length=200), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('since', controlplane.db.UTCDateTime(timezone=True), nullable=False),
    sa.Column('until', controlplane.db.UTCDateTime(timezone=True), nullable=True),
    sa.Column('status', sa.String(length=20), nullable=False),
    sa.Column('status_reason', sa.Text(), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('layers', sa.JSON(), nullable=False),
    sa.Column('curve', sa.JSON(), nullable=False),
    sa.Column('summary', sa.JSON(), nullable=False),
    sa.Column('result_version', sa.Integer(), nullable=True),
    sa.Column('promotion', sa.String(length=20), nullable=True),
    sa.Column('decided_by', sa.String(length=200), nullable=True),
    sa.Column('created_at', controlplane.db.UTCDateTime(timezone=True), nullable=False),
    sa.Column('started_at', controlplane.db.UTCDateTime(timezone=True), nullable=True),
    sa.Column('finished_at', controlplane.db.UTCDateTime(timezone=True), nullable=True),
    sa.Column('updated_at', controlplane.db.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['deployment_id'], ['deployments.id'], name=op.f('fk_calibration_jobs_deployment_id_deployments'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_calibration_jobs'))
    )
    with op.batch_alter_table('calibration_jobs', schema=None) as batch_op:
        batch_op.create_index('ix_calibration_jobs_deployment_id_id', ['deployment_id', 'id'], unique=False)

    op.create_table('canary_runs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('deployment_id', sa.Integer(), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('baseline_version', sa.Integer(), nullable=False),
    sa.Column('job_id', sa.Integer(), nullable=True),
    sa.Column('status', sa.String(length=20), nullable=False),
    sa.Column('status_reason', sa.Text(), nullable=False),
    sa.Column('clean_windows', sa.Integer(), nullable=False),
    sa.Column('failed_checks', sa.Integer(), nullable=False),
    sa.Column('inconclusive_windows', sa.Integer(), nullable=False),
    sa.Column('next_window_start', controlplane.db.UTCDateTime(timezone=True), nullable=False),
    sa.Column('checks', sa.JSON(), nullable=False),
    sa.Column('started_at', controlplane.db.UTCDateTime(timezone=True), nullable=False),
    sa.Column('finished_at', controlplane.db.UTCDateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['deployment_id'], ['deployments.id'], name=op.f('fk_canary_runs_deployment_id_deployments'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['job_id'], ['calibration_jobs.id'], name=op.f('fk_canary_runs_job_id_calibration_jobs'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_canary_runs'))
    )
    with op.batch_alter_table('canary_runs', schema=None) as batch_op:
        batch_op.create_index('ix_canary_runs_deployment_id_id', ['deployment_id', 'id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('canary_runs', schema=None) as batch_op:
        batch_op.drop_index('ix_canary_runs_deployment_id_id')
    op.drop_table('canary_runs')
    with op.batch_alter_table('calibration_jobs', schema=None) as batch_op:
        batch_op.drop_index('ix_calibration_jobs_deployment_id_id')
    op.drop_table('calibration_jobs')
