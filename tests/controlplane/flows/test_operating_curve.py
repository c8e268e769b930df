"""The live operating curve: the workers' pass stores the frontier with the deployment's sets
marked on it, the API reads the stored row only, easier traffic raises an opportunity finding
(info, never paged) and queues one recalibration, stationary traffic queues none, and a
deployment with a schedule re-tunes when due."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.alerts.models import Alert
from controlplane.alerts.service import list_alerts
from controlplane.calibration.learn_then_test import calibrate_thresholds
from controlplane.calibration.models import CalibrationJob, OperatingCurve
from controlplane.db import session_scope, utcnow
from controlplane.deployments.service import get_deployment, move_alias, publish
from controlplane.flows.operating_curve import latest_curve, refresh_deployment
from controlplane.settings import Settings
from tests.support.calibration import (
    FULL,
    LAYERS,
    make_deployment,
    separable_samples,
    write_fleet_traffic,
)

HARD = 0.6  # a layer's answer matches full depth above this signal


def _settings(db_url, **overrides) -> Settings:
    return Settings(database_url=db_url, **({"calibration_min_samples": 300,
                                             "operating_curve_window_s": 3600} | overrides))


def _activate(engine, thresholds: dict[int, float]) -> int:
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        made = publish(session=session, deployment=deployment, thresholds=thresholds,
                       reason="test", actor="test")
        move_alias(session=session, deployment=deployment, alias="active",
                   version=made.version, actor="test", reason="test")
        return made.version


def _traffic(engine, n, *, seed, mismatch_below=HARD, minutes_ago=20, create=False):
    signals, matched = separable_samples(n, seed=seed, mismatch_below=mismatch_below,
                                         noise=0.02)
    with session_scope(engine) as session:
        if create:
            make_deployment(session)
        write_fleet_traffic(session, "chat", signals, matched,
                            start=utcnow() - timedelta(minutes=minutes_ago))
    return signals, matched


def _refresh(engine, settings, now=None) -> dict:
    with session_scope(engine) as session:
        return refresh_deployment(session=session, deployment=get_deployment(
            session=session, name="chat"), settings=settings, now=now)


def _certified_on(signals, matched, seed) -> dict[int, float]:
    """The set a calibration certifies on this traffic (as the active set was)."""
    requests = np.array([i // 64 for i in range(len(signals))])
    return calibrate_thresholds(signals=signals, matched=matched, exit_layers=LAYERS,
                                num_layers=FULL, delta=0.05, epsilon=0.1, seed=seed,
                                min_samples_per_layer=300, requests=requests).thresholds


def test_the_pass_stores_points_and_marks_and_the_api_only_reads(engine, db_url, outbox,
                                                                  client, tokens):
    _traffic(engine, 3000, seed=1, create=True)
    operator = tokens.headers(tokens.operator)
    path = "/v1/deployments/chat/operating-curve"
    assert client.get(path, headers=operator).status_code == 404
    _activate(engine, {3: 0.95, 6: 0.9, 9: 0.85})
    _refresh(engine, _settings(db_url))
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        stored = latest_curve(session, deployment)
    assert stored["evidence"]["tokens"] == 3000 and stored["evidence"]["witnesses"] == 3
    assert stored["evidence"]["cost_model"] is None
    points = stored["points"]
    assert len(points) >= 3 and points[0]["exit_rate"] == 0.0
    assert sum(point["chosen"] for point in points) == 1
    assert stored["best"]["chosen"] and stored["best"]["disagreement_bound"] <= 0.05 + 1e-9
    # exit rate rises along the path, the marks sit on the same evidence
    rates = [point["exit_rate"] for point in points]
    assert rates == sorted(rates)
    assert set(stored["marks"]) >= {"active", "conservative"}
    assert stored["marks"]["conservative"]["exit_rate"] == 0.0
    assert stored["marks"]["active"]["version"] == 2
    assert stored["gap"]["net_saving"] == pytest.approx(
        stored["best"]["net_saving"] - stored["marks"]["active"]["net_saving"])
    answer = client.get(path, headers=operator)
    assert answer.status_code == 200 and answer.json()["points"] == points
    # new traffic changes nothing until the workers draw again: the route never computes
    _traffic(engine, 1500, seed=9, mismatch_below=0.1, minutes_ago=5)
    again = client.get(path, headers=operator).json()
    assert again["computed_at"] == answer.json()["computed_at"]
    assert again["evidence"]["tokens"] == 3000
    assert client.get(f"{path}?segment=code", headers=operator).status_code == 404


def test_easier_traffic_raises_an_opportunity_and_queues_one_recalibration(engine, db_url,
                                                                           outbox):
    hard, matched = separable_samples(3000, seed=2, mismatch_below=0.9, noise=0.02)
    with session_scope(engine) as session:
        make_deployment(session)
    # the active set was certified on hard traffic; the traffic is now easier
    _activate(engine, _certified_on(hard, matched, seed=2))
    _traffic(engine, 3000, seed=3, mismatch_below=0.3)
    settings = _settings(db_url, opportunity_cooldown_s=3600, operating_curve_window_s=3 * 3600)
    done = _refresh(engine, settings)
    job_id = done["segments"]["default"]["opportunity"]
    assert job_id is not None
    with Session(engine) as session:
        job = session.get(CalibrationJob, job_id)
        assert job.trigger == "opportunity" and job.status == "queued"
        assert job.segment is None
        (alert,) = list_alerts(session=session, kind="opportunity", status="open")
        assert alert.severity == "info" and "more net time" in alert.summary
        curve = session.scalars(select(OperatingCurve)).one()
        assert curve.opportunity["qualifies"] and curve.gap["net_saving"] > 0.1
    assert ("calibration.run", [job_id]) in outbox
    # seen again while the job is open, and after it finished within the cooldown: no new job
    assert _refresh(engine, settings)["segments"]["default"]["opportunity"] is None
    with session_scope(engine) as session:
        session.get(CalibrationJob, job_id).status = "failed"
    assert _refresh(engine, settings)["segments"]["default"]["opportunity"] is None
    # past the cooldown, the same opportunity queues another
    later = utcnow() + timedelta(seconds=settings.opportunity_cooldown_s + 60)
    assert _refresh(engine, settings, now=later)["segments"]["default"]["opportunity"] \
        not in (None, job_id)
    with Session(engine) as session:
        assert len(session.scalars(select(Alert).where(Alert.kind == "opportunity")).all()) == 1


def test_an_opportunity_finding_never_pages(engine, db_url, outbox):
    from controlplane.alerts.hook_service import create_hook, hooks_for

    hard, matched = separable_samples(3000, seed=2, mismatch_below=0.9, noise=0.02)
    with session_scope(engine) as session:
        make_deployment(session)
        create_hook(session=session, name="pager", kind="pagerduty",
                    url="https://events.pagerduty.com/v2/enqueue", actor="test",
                    min_severity="info", routing_key="key")
        create_hook(session=session, name="chat-room", kind="slack",
                    url="https://hooks.slack.com/services/x", actor="test",
                    min_severity="info")
    _activate(engine, _certified_on(hard, matched, seed=2))
    _traffic(engine, 3000, seed=3, mismatch_below=0.3)
    _refresh(engine, _settings(db_url))
    with Session(engine) as session:
        (alert,) = list_alerts(session=session, kind="opportunity")
        assert [hook.kind for hook in hooks_for(session=session, alert=alert,
                                                event="firing")] == ["slack"]


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_stationary_traffic_queues_no_opportunity(engine, db_url, outbox, seed):
    earlier, matched = separable_samples(3000, seed=seed, mismatch_below=HARD, noise=0.02)
    with session_scope(engine) as session:
        make_deployment(session)
    _activate(engine, _certified_on(earlier, matched, seed=seed))
    _traffic(engine, 3000, seed=seed + 100)
    done = _refresh(engine, _settings(db_url))
    assert done["segments"]["default"]["opportunity"] is None
    with Session(engine) as session:
        assert list_alerts(session=session, kind="opportunity") == []
        assert session.scalars(select(CalibrationJob)).all() == []
        assert not session.scalars(select(OperatingCurve)).one().opportunity["qualifies"]


def test_a_schedule_queues_a_recalibration_when_due(engine, db_url, outbox):
    with session_scope(engine) as session:
        make_deployment(session, retune_every_s=3600)
        make_deployment(session, name="unscheduled")
    settings = _settings(db_url)
    assert _refresh(engine, settings)["scheduled"] is not None
    with Session(engine) as session:
        (job,) = session.scalars(select(CalibrationJob)).all()
        assert job.trigger == "schedule" and job.segment is None
    # not due again until retune_every_s after the last job
    with session_scope(engine) as session:
        session.get(CalibrationJob, job.id).status = "failed"
    assert _refresh(engine, settings)["scheduled"] is None
    later = utcnow() + timedelta(seconds=3700)
    assert _refresh(engine, settings, now=later)["scheduled"] not in (None, job.id)
    with session_scope(engine) as session:
        unscheduled = get_deployment(session=session, name="unscheduled")
        assert refresh_deployment(session=session, deployment=unscheduled,
                                  settings=settings)["scheduled"] is None


def test_an_opportunity_recalibrates_on_the_traffic_since_the_last_curve_without_one(
        engine, db_url, outbox):
    hard, matched = separable_samples(3000, seed=2, mismatch_below=0.9, noise=0.02)
    with session_scope(engine) as session:
        make_deployment(session)
    _activate(engine, _certified_on(hard, matched, seed=2))
    _traffic(engine, 3000, seed=5, mismatch_below=0.9, minutes_ago=40)
    settings = _settings(db_url, operating_curve_window_s=3 * 3600)
    first = utcnow() - timedelta(minutes=25)
    assert _refresh(engine, settings, now=first)["segments"]["default"]["opportunity"] is None
    _traffic(engine, 6000, seed=6, mismatch_below=0.3, minutes_ago=20)
    job_id = _refresh(engine, settings)["segments"]["default"]["opportunity"]
    assert job_id is not None
    with Session(engine) as session:
        assert session.get(CalibrationJob, job_id).since == first


def test_retune_every_s_is_set_read_and_turned_off_over_the_api(client, tokens):
    admin = tokens.headers(tokens.admin)
    made = client.post("/v1/deployments", headers=admin, json={
        "name": "tuned", "model_ref": "tiny", "num_layers": FULL, "exit_layers": LAYERS,
        "retune_every_s": 7200})
    assert made.status_code == 201, made.text
    assert made.json()["retune_every_s"] == 7200
    too_often = client.post("/v1/deployments", headers=admin, json={
        "name": "eager", "model_ref": "tiny", "num_layers": FULL, "retune_every_s": 5})
    assert too_often.status_code == 422
    off = client.patch("/v1/deployments/tuned", headers=admin, json={"retune_every_s": 0})
    assert off.status_code == 200 and not off.json()["retune_every_s"]
    assert client.get("/v1/deployments/tuned", headers=admin).json()["retune_every_s"] == 0
