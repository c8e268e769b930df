"""Evidently reports of alerts, stored in the database: the worker that renders a report and
the API replica that serves it need share nothing but the store.

A report is kept gzip-compressed, at most `EXITPLANE_REPORT_MAX_BYTES` of it (a larger one is
not kept: the alert's evidence stays, its report link does not appear), and for
`EXITPLANE_REPORT_RETENTION_DAYS` (the daily retention task drops older ones).
"""

from __future__ import annotations

import gzip
import logging
from datetime import datetime

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from controlplane.alerts.models import Alert, AlertReport
from controlplane.db import utcnow
from controlplane.errors import NotFound

log = logging.getLogger("exitplane.alerts")
# The Evidently report runs its own scripts: in a sandbox (opaque origin, no cookies, no forms).
REPORT_HEADERS = {"Content-Security-Policy": "sandbox allow-scripts; default-src 'self' "
                  "'unsafe-inline' data: blob:", "Cache-Control": "no-store"}


def store_report(*, session: Session, alert: Alert, html: str, max_bytes: int) -> bool:
    """Keep `html` as `alert`'s report (replacing one kept before); False when even
    compressed it is larger than `max_bytes`."""
    raw = html.encode("utf-8")
    packed = gzip.compress(raw, compresslevel=6, mtime=0)
    if len(packed) > max_bytes:
        log.warning("the report of alert %s is %d bytes compressed, above "
                    "EXITPLANE_REPORT_MAX_BYTES=%d; not kept", alert.id, len(packed), max_bytes)
        return False
    session.merge(AlertReport(alert_id=alert.id, html_gzip=packed, html_bytes=len(raw),
                              created_at=utcnow()))
    alert.has_report = True
    session.flush()
    return True


def report_html(*, session: Session, alert: Alert) -> bytes:
    """The stored report of `alert` as UTF-8 HTML, or NotFound."""
    if not alert.has_report:
        raise NotFound(f"alert {alert.id} has no report")
    packed = session.scalar(select(AlertReport.html_gzip).where(AlertReport.alert_id == alert.id))
    if packed is None:
        raise NotFound(f"the report of alert {alert.id} is no longer stored")
    return gzip.decompress(packed)


def purge_reports(*, session: Session, older_than: datetime) -> int:
    """Drop reports created before `older_than`; their alerts no longer link one."""
    old = select(AlertReport.alert_id).where(AlertReport.created_at < older_than)
    session.execute(update(Alert).where(Alert.id.in_(old)).values(has_report=False),
                    execution_options={"synchronize_session": False})
    dropped = session.execute(delete(AlertReport).where(AlertReport.created_at < older_than))
    session.flush()
    return dropped.rowcount or 0
