"""The loop the product exists for, end to end with the tiny model: a runtime serves domain A
with an aggressive operator-tuned set, traffic switches to domain B where that set answers
wrong too often, the real drift check fires `quality_regression`, the conservative set becomes
active at once and the runtime applies it, the recalibration job runs on B's shadow samples since
the alert and publishes, the runtime applies the new set, and on fresh B traffic its
disagreement with full depth stays within δ while tokens exit early again."""

from __future__ import annotations

import itertools

import httpx
import numpy as np
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.auth.service import create_token
from controlplane.calibration import service
from controlplane.calibration.models import CalibrationJob
from controlplane.db import session_scope
from controlplane.deployments.service import aliases_of, get_deployment
from controlplane.drift.service import DriftOptions, check_deployment
from controlplane.flows import recalibration
from controlplane.telemetry.service import disagreement, exit_rates
from exitplane.client.shipper import TelemetryShipper
from exitplane.client.thresholds import ThresholdClient
from runtime.engine import Engine, EngineConfig
from runtime.model import tiny_llama
from tests.support.network import free_port
from tests.support.runtime_link import ControlPlane
from tests.support.waiting import wait_until

# slow: the whole loop end to end, minutes
pytestmark = [pytest.mark.slow, pytest.mark.integration,
              pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)]

NAME = "tiny-loop"
LAYERS = [2, 4]
DELTA, EPSILON = 0.2, 0.1
DOMAINS = {"A": (3, 40), "B": (60, 128)}  # prompt token ranges


class Runtime:
    """Engine + threshold client + shipper, wired as the runtime server wires them."""

    def __init__(self, url: str, token: str, tmp_path) -> None:
        self.shipper = TelemetryShipper(
            base_url=url, token=token, deployment=NAME, runtime_id="rt-loop", num_layers=6,
            spool_dir=tmp_path / "spool", batch_records=500, batch_interval_s=0.2)
        self.engine = Engine(tiny_llama(num_layers=6), exit_layers=LAYERS,
                             config=EngineConfig(max_batch=32, max_seq_len=64,
                                                 shadow_rate=0.75),
                             runtime_id="rt-loop", on_record=self.shipper.submit)
        self.client = ThresholdClient(
            self.engine, base_url=url, deployment=NAME, token=token,
            cache_path=tmp_path / "thresholds.json", long_poll_s=1.0, heartbeat_interval_s=1.0,
            backoff_initial_s=0.05, backoff_max_s=0.5, telemetry=self.shipper)
        self.shipper.start()
        self.client.start()
        self._ids = itertools.count()

    def serve(self, domain: str, requests: int, tokens: int = 16) -> None:
        rng = np.random.default_rng(len(domain) * 1000 + next(self._ids))
        low, high = DOMAINS[domain]
        for _ in range(requests):
            prompt = [1, *(int(t) for t in rng.integers(low, high, size=4))]
            self.engine.add_request(prompt, request_id=f"{domain}-{next(self._ids)}",
                                    max_new_tokens=tokens, stop_token_ids=())
        while self.engine.has_work:
            self.engine.step()
        assert self.shipper.flush(60)

    def applies(self, version: int) -> bool:
        return self.client.applied_version == version

    def close(self) -> None:
        self.client.stop()
        assert self.shipper.close(20)


@pytest.fixture
def plane(settings, engine, outbox):
    from exitplane.app import create_app

    control = ControlPlane(make_app=lambda: create_app(settings, engine=engine),
                           port=free_port()).start()
    yield control
    control.close()


def test_domain_shift_fallback_recalibration_and_recovery(plane, tokens, engine, tmp_path):
    with httpx.Client(base_url=plane.url, headers=tokens.headers(tokens.operator),
                      timeout=30) as http:
        assert http.post("/v1/deployments", json={
            "name": NAME, "model_ref": "tiny-llama", "num_layers": 6, "exit_layers": LAYERS,
            "signal": "maxprob", "delta": DELTA, "epsilon": EPSILON}).status_code == 201
        tuned = http.post(f"/v1/deployments/{NAME}/threshold-sets", json={
            "thresholds": {"2": 0.1, "4": 0.1}, "reason": "tuned by hand for domain A",
            "activate": True}).json()["version"]
    with Session(engine) as session:
        deployment = get_deployment(session=session, name=NAME)
        _, secret = create_token(session=session, name="rt-loop", scope="runtime",
                                 deployment=deployment)
        session.commit()
    runtime = Runtime(plane.url, secret, tmp_path)
    try:
        wait_until(lambda: runtime.applies(tuned), message="the runtime applies the tuned set")
        runtime.serve("A", requests=16, tokens=8)
        runtime.serve("B", requests=32)  # the traffic shifts

        with session_scope(engine) as session:
            deployment = get_deployment(session=session, name=NAME)
            fired = check_deployment(session=session, deployment=deployment,
                                     options=DriftOptions())
            kinds = {alert.kind for alert in fired.fired}
            assert "quality_regression" in kinds, [a.summary for a in fired.fired]
            assert aliases_of(session=session, deployment=deployment)["active"] == 1
        wait_until(lambda: runtime.applies(1), message="the runtime applies the conservative set")

        runtime.serve("B", requests=80)  # shadow samples of B since the alert
        with session_scope(engine) as session:
            job = session.scalars(select(CalibrationJob)).one()
            assert job.trigger == "alert" and service.start_job(session=session, job=job)
        with session_scope(engine) as session:
            job = recalibration.run_calibration(
                session=session, job=session.get(CalibrationJob, job.id),
                policy=service.CalibrationPolicy(min_samples_per_layer=300, seed=0))
            assert job.status == "succeeded", job.status_reason
            recalibrated = job.result_version
            if job.promotion == "awaiting_approval":
                # one runtime is one witness: reopening exits from never-exit with no last
                # good version to bound it waits for an operator, who approves here
                recalibration.approve(session=session, deployment=get_deployment(
                    session=session, name=NAME), job=job, actor="ops", reason="checked")
        wait_until(lambda: runtime.applies(recalibrated),
                   message="the runtime applies the recalibrated set")

        runtime.serve("B", requests=48)
        with Session(engine) as session:
            deployment = get_deployment(session=session, name=NAME)
            since = job.finished_at.replace(second=0, microsecond=0)
            windows = disagreement(session=session, deployment=deployment, since=since,
                                   version=recalibrated)
            shadow = sum(w["shadow_tokens"] for w in windows)
            wrong = sum(w["mismatches"] for w in windows)
            rates = exit_rates(session=session, deployment=deployment, since=since,
                               version=recalibrated)
            exits = sum(r["exits"] for r in rates if r["layer"] in LAYERS)
        assert shadow >= 300
        assert wrong / shadow <= DELTA, (wrong, shadow, job.summary)
        assert exits > 0  # speed comes back: tokens leave early under the new set
    finally:
        runtime.close()
