"""The operating-curve tasks on a real worker: beat's entry fans out to every deployment, and
each deployment's curve is drawn and stored with its sets marked."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.calibration.models import OperatingCurve
from controlplane.celery_app import make_celery
from controlplane.db import session_scope, utcnow
from controlplane.settings import Settings
from tests.support.calibration import make_deployment, separable_samples, write_fleet_traffic
from tests.support.waiting import wait_until


def test_beat_redraws_the_curves_at_the_configured_interval(tmp_path):
    app = make_celery(Settings(var_dir=tmp_path, operating_curve_interval_s=42.0))
    entry = app.conf.beat_schedule["operating-curve"]
    assert entry["task"] == "curve.refresh_all" and entry["schedule"] == 42.0
    assert "workers.tasks.curve" in app.conf.include


def test_the_worker_draws_and_stores_each_deployments_curve(engine, stack):
    app, _ = stack
    signals, matched = separable_samples(3000, seed=8, noise=0.02)
    with session_scope(engine) as session:
        make_deployment(session)
        make_deployment(session, name="idle")
        write_fleet_traffic(session, "chat", signals, matched,
                            start=utcnow() - timedelta(minutes=20))
    app.send_task("curve.refresh_all")

    def stored():
        with Session(engine) as session:
            return {row.deployment_id: row for row in session.scalars(select(OperatingCurve))}

    rows = wait_until(lambda: len(stored()) == 2 and stored(), timeout=120)
    chat, idle = sorted(rows.values(), key=lambda row: row.deployment_id)
    assert chat.points and chat.best["chosen"] and chat.marks["active"]["version"] == 1
    assert chat.evidence["tokens"] == 3000
    assert idle.points == [] and "not enough shadow samples" in idle.evidence["note"]
