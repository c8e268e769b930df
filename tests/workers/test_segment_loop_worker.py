"""The per-segment loop on a real Celery worker: a quality alert on code falls back
code alone in the alert's transaction, and the worker's recalibration reads code's shadow
tokens only and gives code a map of its own again while chat keeps its thresholds."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.alerts.service import Condition, fire
from controlplane.calibration.models import CalibrationJob
from controlplane.db import session_scope, utcnow
from controlplane.deployments.service import (
    aliases_of,
    get_deployment,
    get_threshold_set,
    move_alias,
    publish,
)
from tests.support.calibration import (
    make_deployment,
    separable_samples,
    wait_for_job,
    write_fleet_traffic,
)

pytestmark = pytest.mark.slow  # a real Celery worker process

CHAT = {3: 0.97, 6: 0.93, 9: 0.9}


def test_a_code_regression_recalibrates_code_alone_on_the_worker(engine, stack):
    _, worker = stack
    fired_at = utcnow() - timedelta(hours=1)
    with session_scope(engine) as session:
        deployment = make_deployment(session)
        version = publish(session=session, deployment=deployment,
                          thresholds={3: 0.95, 6: 0.9, 9: 0.85}, actor="ops", reason="old",
                          segments={"chat": CHAT, "code": {3: 0.2, 6: 0.2, 9: 0.2}}).version
        move_alias(session=session, deployment=deployment, alias="active", version=version,
                   actor="ops", reason="old traffic")
        # code matches full depth above 0.5, chat only above 0.9
        for segment, boundary, seed in (("code", 0.5, 8), ("chat", 0.9, 9)):
            signals, matched = separable_samples(3000, seed=seed, mismatch_below=boundary)
            write_fleet_traffic(session, "chat", signals, matched,
                                runtimes=tuple(f"rt-{segment}-{k}" for k in range(3)),
                                start=fired_at + timedelta(minutes=1), segment=segment)
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        fire(session=session, deployment=deployment, now=fired_at, condition=Condition(
            kind="quality_regression", severity="critical", segment="code",
            summary="segment code: disagreement above δ"))
        fallen = aliases_of(session=session, deployment=deployment)["active"]
        assert get_threshold_set(session=session, deployment=deployment,
                                 version=fallen).segments_by_layer()["code"] == {
            3: 1.0, 6: 1.0, 9: 1.0}
    with Session(engine) as session:
        job_id = session.scalars(select(CalibrationJob.id)).one()
    job = wait_for_job(engine, job_id)
    assert job.status == "succeeded", f"{job.status_reason}\n{worker.log.read_text()[-3000:]}"
    assert job.segment == "code" and job.summary["samples"]["total"] == 3000
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        assert aliases_of(session=session, deployment=deployment)["active"] == job.result_version
        published = get_threshold_set(session=session, deployment=deployment,
                                      version=job.result_version)
        assert published.parent_version == fallen
        segments = published.segments_by_layer()
        assert segments["chat"] == CHAT and max(segments["code"].values()) < 0.9
        assert published.thresholds_by_layer() == {3: 0.95, 6: 0.9, 9: 0.85}
