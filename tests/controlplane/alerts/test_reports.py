"""Evidently reports kept in the database: stored compressed with their alert, refused above
the size bound, dropped by retention (the alert then links none), gone with their alert."""

from __future__ import annotations

import base64
import os
from datetime import timedelta

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controlplane.alerts.models import Alert, AlertReport
from controlplane.alerts.reports import purge_reports, report_html, store_report
from controlplane.alerts.service import Condition, fire
from controlplane.db import utcnow
from controlplane.deployments.models import Deployment
from controlplane.errors import NotFound
from tests.support.alerts import make_deployment

HTML = "<html><body>" + "<p>drift at layer 6</p>" * 5000 + "</body></html>"


def _alert(session: Session, html: str | None = HTML, keep: bool = True) -> Alert:
    deployment = session.scalar(select(Deployment)) or make_deployment(session)
    alert, _ = fire(session=session, deployment=deployment, keep_report=keep,
                    condition=Condition(kind="distribution_drift", severity="info",
                                        summary="moved", report_html=html))
    return alert


def test_a_report_is_stored_compressed_and_read_back(session: Session, outbox):
    alert = _alert(session)
    assert alert.has_report
    assert report_html(session=session, alert=alert).decode() == HTML
    stored = session.get(AlertReport, alert.id)
    assert stored.html_bytes == len(HTML) and len(stored.html_gzip) < len(HTML) / 20


def test_a_report_is_only_kept_when_asked(session: Session, outbox):
    alert = _alert(session, keep=False)
    assert not alert.has_report
    with pytest.raises(NotFound, match="has no report"):
        report_html(session=session, alert=alert)


def test_an_open_alert_without_a_report_gets_one_when_it_is_seen_again(session: Session,
                                                                         outbox):
    alert = _alert(session, html=None)
    assert not alert.has_report
    again = _alert(session)
    assert again.id == alert.id and again.has_report
    assert report_html(session=session, alert=again).decode() == HTML


def test_a_report_above_the_bound_is_not_kept(session: Session, outbox):
    alert = _alert(session, keep=False)
    noise = base64.b64encode(os.urandom(60_000)).decode()  # ~60 kB however compressed
    assert not store_report(session=session, alert=alert, html=noise, max_bytes=50_000)
    assert not alert.has_report and session.get(AlertReport, alert.id) is None
    assert store_report(session=session, alert=alert, html=noise, max_bytes=100_000)
    assert alert.has_report


def test_retention_drops_old_reports_and_their_links(session: Session, outbox):
    alert = _alert(session)
    session.get(AlertReport, alert.id).created_at = utcnow() - timedelta(days=40)
    session.flush()
    assert purge_reports(session=session, older_than=utcnow() - timedelta(days=50)) == 0
    assert purge_reports(session=session, older_than=utcnow() - timedelta(days=30)) == 1
    session.refresh(alert)
    assert not alert.has_report
    with pytest.raises(NotFound):
        report_html(session=session, alert=alert)


def test_a_report_goes_with_its_alert(session: Session, outbox):
    alert = _alert(session)
    session.delete(alert)
    session.flush()
    assert session.scalar(select(func.count()).select_from(AlertReport)) == 0
