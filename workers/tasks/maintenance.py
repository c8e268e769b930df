"""Housekeeping: telemetry and report retention, and the coming days' partitions."""

from __future__ import annotations

from datetime import timedelta

from celery import shared_task

from controlplane.alerts.reports import purge_reports
from controlplane.db import get_engine, session_scope, utcnow
from controlplane.settings import get_settings
from controlplane.telemetry.service import ensure_partitions, purge
from workers.tasks import RETRY_ON_STORE_ERRORS


@shared_task(name="retention.run", **RETRY_ON_STORE_ERRORS)
def run_retention() -> dict:
    """Drop telemetry and drift reports older than their retention periods; create the next
    days' partitions."""
    settings = get_settings()
    older_than = utcnow() - timedelta(days=settings.telemetry_retention_days)
    reports_before = utcnow() - timedelta(days=settings.report_retention_days)
    with session_scope(get_engine(settings.effective_database_url)) as session:
        deleted = purge(session=session, older_than=older_than)
        ensure_partitions(session=session)
        reports = purge_reports(session=session, older_than=reports_before)
    return {"older_than": older_than.isoformat(), **deleted, "reports": reports}
