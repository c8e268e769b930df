"""An Evidently report rendered by a real Celery worker process is served by a real API process
that shares nothing with it but the store: each runs in its own working directory with its own
EXITPLANE_VAR_DIR (as two Kubernetes pods with their own disks), PostgreSQL store, Redis
broker."""

from __future__ import annotations

import os
import secrets
from datetime import timedelta

import httpx
import pytest
import redis
from celery import Celery
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.alerts.models import Alert
from controlplane.alerts.reports import report_html
from controlplane.auth.service import create_token
from controlplane.celery_app import QUEUE
from controlplane.db import make_engine, utcnow
from tests.support.alerts import Phase, make_deployment, send_traffic
from tests.support.network import free_port
from tests.support.processes import EXITPLANE, answers, print_tails, spawn, stop_processes
from tests.support.services import POSTGRES_URL, REDIS_URL, empty_postgres
from tests.support.waiting import patient_get, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]


def test_a_report_the_worker_rendered_is_served_by_an_api_on_another_disk(postgres_migrated,
                                                                          tmp_path):
    if not (POSTGRES_URL and REDIS_URL):
        raise RuntimeError("set EXITPLANE_TEST_POSTGRES_URL and EXITPLANE_TEST_REDIS_URL")
    empty_postgres(postgres_migrated)
    engine = make_engine(postgres_migrated)
    now = utcnow().replace(second=30, microsecond=0)
    start = (now - timedelta(minutes=30)).replace(second=0)
    with Session(engine) as session:  # exit rates that moved: a distribution-drift finding
        deployment = make_deployment(session, activated_at=start)
        send_traffic(session, deployment, start=start, seed=2,
                     phases=[Phase(15, (0.25, 0.4, 0.3)), Phase(15, (0.25, 0.1, 0.3))])
        _, secret = create_token(session=session, name="ops", scope="operator")
        session.commit()
        deployment_id = deployment.id

    redis_url = REDIS_URL.rsplit("/", 1)[0] + "/13"  # a database of this module's own
    redis.Redis.from_url(redis_url).flushdb()
    base = {key: value for key, value in os.environ.items() if not key.startswith("EXITPLANE_")}
    base.update({"EXITPLANE_ENVIRONMENT": "production", "EXITPLANE_DATABASE_URL": postgres_migrated,
                 "EXITPLANE_REDIS_URL": redis_url,
                 "EXITPLANE_SECRET_KEY": secrets.token_urlsafe(48)})
    port = free_port()
    disks = {name: tmp_path / name for name in ("worker", "api")}
    processes = []
    for name, command in (("worker", ["worker"]),
                          ("api", ["up", "--port", str(port), "--no-migrate", "--no-workers"])):
        disks[name].mkdir()
        processes.append(spawn([EXITPLANE, *command], out=tmp_path / f"{name}.log",
                               cwd=disks[name],
                               env={**base, "EXITPLANE_VAR_DIR": str(disks[name] / "var")}))
    celery = Celery(broker=redis_url, backend=redis_url)
    try:
        wait_until(lambda: answers(f"http://127.0.0.1:{port}/readyz"), 90, "the API to be ready")
        celery.send_task("drift.detect", args=[deployment_id], queue=QUEUE)

        def reported_alerts() -> list[Alert]:
            with Session(engine) as session:
                return session.scalars(select(Alert).where(Alert.has_report)).all()

        reported = wait_until(reported_alerts, 180, "the worker to store an alert's report")
        api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30,
                           headers={"Authorization": f"Bearer {secret}"})
        shown = patient_get(api, f"/v1/alerts/{reported[0].id}").json()
        assert shown["report_url"].endswith(f"/v1/alerts/{reported[0].id}/report")
        report = patient_get(api, f"/v1/alerts/{reported[0].id}/report")
        assert report.status_code == 200, report.text
        assert report.headers["content-type"].startswith("text/html")
        with Session(engine) as session:
            stored = report_html(session=session, alert=session.get(Alert, reported[0].id))
        assert report.content == stored and b"root_metric_" in stored  # Evidently's widgets
        print(f"report of alert {reported[0].id}: {len(stored)} bytes of HTML")
        assert "sandbox" in report.headers["content-security-policy"]
        # Neither process wrote a report file on its disk.
        assert not [p for disk in disks.values() for p in disk.rglob("*.html")]
    finally:
        celery.close()
        stop_processes(processes)
        engine.dispose()
        print_tails(tmp_path.glob("*.log"), 3000)
