"""Answer consistency from stored shadow requests: per version and segment over the API, in the
what-if and on the operating curve, equal to the exact answer loss computed on the same
requests; and a recalibration with an answer target that certifies it, records its figures,
keeps the requests that test it out of the path, and waits when they are too few."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import numpy as np
import pytest
from sqlalchemy.orm import Session

from controlplane.calibration import service
from controlplane.calibration.models import CalibrationJob
from controlplane.db import session_scope, utcnow
from controlplane.deployments.service import get_deployment, move_alias, publish
from controlplane.flows import recalibration
from controlplane.flows.answers import read_answers
from controlplane.flows.answers_report import report
from controlplane.flows.operating_curve import latest_curve, refresh_deployment
from controlplane.flows.what_if import what_if
from controlplane.settings import Settings
from controlplane.stats.answers import first_divergence
from controlplane.telemetry.service import ingest
from exitplane.wire import TelemetryBatch
from tests.support.batches import telemetry_batch
from tests.support.calibration import FULL, LAYERS, make_deployment, write_fleet_traffic
from tests.support.shadow_requests import KnownAnswerRisk, shadow_request_records

MODEL = KnownAnswerRisk(power=(1.0, 2.0, 4.0), tokens=8)
SET = {3: 0.8, 6: 0.7, 9: 0.6}
RUNTIMES = ("rt-1", "rt-2", "rt-3")
POLICY = service.CalibrationPolicy(min_samples_per_layer=300, seed=0, min_shadow_requests=150)


def _send_requests(session, labels, *, version, start, prefix="q"):
    """Ship each (signals, matched) as one shadow request, spread over three runtimes."""
    deployment = get_deployment(session=session, name="chat")
    for index, (signals, matched) in enumerate(labels):
        records = shadow_request_records(signals, matched, request_id=f"{prefix}-{index}",
                                         start=start + index * 0.5, version=version)
        batch = TelemetryBatch.model_validate(telemetry_batch(
            records, runtime_id=RUNTIMES[index % 3], num_layers=FULL))
        ingest(session=session, deployment=deployment, batches=[batch])
    session.flush()


def _labels(seed: int, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [MODEL.tokens_of(rng, MODEL.tokens) for _ in range(n)]


def _truth(labels, thresholds: dict[int, float]) -> np.ndarray:
    row = np.array([[thresholds[k] for k in LAYERS]])
    return np.array([first_divergence(s, m, row)[0] for s, m in labels])


def _seed(engine, *, n=60, delta_answer=None):
    start = (utcnow() - timedelta(minutes=20)).timestamp()
    with session_scope(engine) as session:
        deployment = make_deployment(session, delta_answer=delta_answer)
        made = publish(session=session, deployment=deployment, thresholds=SET, reason="test",
                       actor="test")
        under_one, under_two = _labels(1, n), _labels(2, n)
        _send_requests(session, under_one, version=1, start=start, prefix="a")
        _send_requests(session, under_two, version=made.version, start=start + 100, prefix="b")
    return under_one, under_two


def test_the_api_reports_each_version_on_the_requests_served_under_it(client, tokens, engine):
    _, under_two = _seed(engine, delta_answer=0.3)
    operator = tokens.headers(tokens.operator)
    answer = client.get("/v1/deployments/chat/answers?window=3600", headers=operator)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["requests"] == 120 and body["delta_answer"] == 0.3
    first, second = body["versions"]
    # version 1 never exits: every answer is full depth's
    assert first["version"] == 1 and first["segments"][0]["identical_share"] == 1.0
    assert first["segments"][0]["differing_bound"] < 0.3
    truth = _truth(under_two, SET)
    row = second["segments"][0]
    assert row["segment"] == "default" and row["requests"] == 60
    assert row["differing"] == int((truth >= 0).sum())
    assert row["identical_share"] == pytest.approx(float((truth < 0).mean()))
    assert row["differing_bound"] > row["differing_share"]
    assert row["within_target"] == (row["differing_bound"] <= 0.3)
    assert row["divergence_quantiles"]["p50"] == pytest.approx(
        float(np.median(truth[truth >= 0])))
    only = client.get(f"/v1/deployments/chat/answers?version={second['version']}",
                      headers=operator).json()
    assert [v["version"] for v in only["versions"]] == [second["version"]]
    assert client.get("/v1/deployments/chat/answers?version=9", headers=operator
                      ).status_code == 404
    assert client.get("/v1/deployments/chat/answers?segment=nope", headers=operator
                      ).status_code == 422
    assert client.get("/v1/deployments/chat/answers?window=5", headers=operator
                      ).status_code == 422
    assert client.get("/v1/deployments/chat/answers", headers=tokens.headers("nope")
                      ).status_code == 401


def test_what_if_and_the_operating_curve_report_answers(engine, db_url):
    under_one, under_two = _seed(engine)
    labels = under_one + under_two
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        found = what_if(session=session, deployment=deployment,
                        thresholds={str(k): v for k, v in SET.items()}, window_s=3600,
                        policy=POLICY)
        truth = _truth(labels, SET)
        assert found.answers["requests"] == 120
        assert found.answers["differing"] == int((truth >= 0).sum())
        assert found.as_dict()["answers"]["identical_share"] == pytest.approx(
            float((truth < 0).mean()))
        # the set's tokens are the shadow requests' tokens: the token figures stay as they are
        assert found.tokens == 120 * MODEL.tokens
        move_alias(session=session, deployment=deployment, alias="active", version=2,
                   actor="test", reason="test")
    settings = Settings(database_url=db_url, calibration_min_samples=300,
                        operating_curve_window_s=3600)
    with session_scope(engine) as session:
        refresh_deployment(session=session, deployment=get_deployment(
            session=session, name="chat"), settings=settings)
    with Session(engine) as session:
        curve = latest_curve(session, get_deployment(session=session, name="chat"))
    assert curve["evidence"]["shadow_requests"] == 120
    active = curve["marks"]["active"]
    assert active["answers"]["differing"] == int((truth >= 0).sum())
    for point in curve["points"]:
        thresholds = {int(k): v for k, v in point["thresholds"].items()}
        assert point["answers"]["differing"] == int((_truth(labels, thresholds) >= 0).sum())


def test_what_if_without_shadow_requests_has_no_answers(engine):
    with session_scope(engine) as session:
        make_deployment(session)
        rng = np.random.default_rng(3)
        signals, matched = MODEL.tokens_of(rng, 600)
        write_fleet_traffic(session, "chat", signals, matched,
                            start=utcnow() - timedelta(minutes=10))
        found = what_if(session=session, deployment=get_deployment(session=session, name="chat"),
                        thresholds={"3": 0.8}, window_s=3600, policy=POLICY)
    assert found.answers is None and found.as_dict()["answers"] is None


def _calibrate(engine, since):
    with session_scope(engine) as session:
        job, _ = service.request_calibration(
            session=session, deployment=get_deployment(session=session, name="chat"),
            actor="test", since=since, policy=POLICY)
        job_id = job.id
    with session_scope(engine) as session:
        service.start_job(session=session, job=session.get(CalibrationJob, job_id))
    with session_scope(engine) as session:
        recalibration.run_calibration(session=session, job=session.get(CalibrationJob, job_id),
                                      policy=POLICY)
    with Session(engine) as session:
        return session.get(CalibrationJob, job_id)


def test_a_recalibration_certifies_the_answer_target_and_records_it(engine, outbox):
    since = utcnow() - timedelta(minutes=30)
    rng = np.random.default_rng(9)
    with session_scope(engine) as session:
        make_deployment(session, delta_answer=0.2, delta=0.2)
        signals, matched = MODEL.tokens_of(rng, 3200)
        write_fleet_traffic(session, "chat", signals, matched, request_tokens=8,
                            start=utcnow() - timedelta(minutes=25))
        labels = [MODEL.tokens_of(rng, MODEL.tokens) for _ in range(300)]
        _send_requests(session, labels, version=1,
                       start=(utcnow() - timedelta(minutes=15)).timestamp())
    job = _calibrate(engine, since)
    assert job.status == "succeeded", job.status_reason
    answers = job.summary["answers"]
    assert answers["requests"] == 300 and answers["delta_answer"] == 0.2
    assert answers["p_value"] <= 0.1 and answers["differing_bound"] <= 0.35
    chosen = {int(k): v for k, v in job.summary["thresholds"].items()}
    assert answers["differing"] == int((_truth(labels, chosen) >= 0).sum())
    # the shadow requests' tokens never drew the path: the token test saw the others only
    assert job.summary["samples"]["total"] == 3200
    assert any(point.get("answer_p_value") is not None for point in job.curve)


def test_a_recalibration_without_enough_shadow_requests_waits(engine, outbox):
    since = utcnow() - timedelta(minutes=30)
    rng = np.random.default_rng(10)
    with session_scope(engine) as session:
        make_deployment(session, delta_answer=0.2, delta=0.2)
        signals, matched = MODEL.tokens_of(rng, 3200)
        write_fleet_traffic(session, "chat", signals, matched, request_tokens=8,
                            start=utcnow() - timedelta(minutes=25))
        _send_requests(session, [MODEL.tokens_of(rng, MODEL.tokens) for _ in range(20)],
                       version=1, start=(utcnow() - timedelta(minutes=15)).timestamp())
    job = _calibrate(engine, since)
    assert job.status == "waiting_for_data"
    assert "not enough shadow requests" in job.status_reason
    assert job.summary["counts"] == {"shadow_requests": 20} and job.summary["required"] == 150


def test_requests_served_under_version_zero_are_left_out_of_the_report(client, tokens, engine):
    """A shadow request served under version 0 (the built-in never-exit set a runtime applies
    before its first pull) leaves the stored versions' figures as they are and is not reported;
    `version=0` names no stored set and is refused."""
    _, under_two = _seed(engine)
    with session_scope(engine) as session:
        _send_requests(session, _labels(3, 6), version=0,
                       start=(utcnow() - timedelta(minutes=5)).timestamp(), prefix="z")
    operator = tokens.headers(tokens.operator)
    answer = client.get("/v1/deployments/chat/answers?window=3600", headers=operator)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert [v["version"] for v in body["versions"]] == [1, 2] and body["requests"] == 120
    row = body["versions"][1]["segments"][0]
    assert row["differing"] == int((_truth(under_two, SET) >= 0).sum())
    assert client.get("/v1/deployments/chat/answers?version=0", headers=operator
                      ).status_code == 422


def test_the_report_leaves_out_the_witnesses_the_outlier_screen_sets_aside(engine,
                                                                           monkeypatch):
    """The answers report reads the window as the what-if does: the witnesses the outlier
    screen sets aside on the window's shadow tokens are not in its figures."""
    _seed(engine)
    since, until = utcnow() - timedelta(hours=1), utcnow()
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        before = report(session=session, deployment=deployment, since=since,
                                until=until)
        everyone = read_answers(session=session, deployment=deployment, since=since,
                                        until=until)
        liar = next(witness for witness, runtime
                    in zip(everyone.witnesses, everyone.runtimes, strict=True)
                    if runtime == "rt-2")

        def screen(**_) -> SimpleNamespace:
            return SimpleNamespace(findings=[SimpleNamespace(runtime_id=liar)])

        monkeypatch.setattr("controlplane.flows.what_if.screen_witnesses", screen)
        after = report(session=session, deployment=deployment, since=since,
                               until=until)
    assert before["requests"] == 120
    assert after["requests"] == 80  # rt-2 served a third of each version's requests
