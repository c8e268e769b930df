"""The canary's answer check: with an answer target, the members' shadow requests at the
candidate fail a canary whose whole answers differ significantly above δ_answer even when its
tokens look clean, keep windows inconclusive until they bound answers within δ_answer, and let
it be promoted once they do; a deployment without an answer target is judged on tokens alone."""

from __future__ import annotations

from datetime import timedelta
from itertools import count, islice

import numpy as np
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.alerts.models import Alert
from controlplane.db import session_scope, utcnow
from controlplane.deployments.service import (
    aliases_of,
    get_deployment,
    in_canary,
    move_alias,
    publish,
)
from controlplane.flows.canary import CanaryPolicy, evaluate_canary, start_canary
from controlplane.telemetry.service import ingest
from exitplane.wire import TelemetryBatch
from tests.support.batches import telemetry_batch
from tests.support.calibration import FULL, make_deployment, separable_samples, write_traffic
from tests.support.shadow_requests import shadow_request_records

STABLE = {3: 0.9, 6: 0.9, 9: 0.9}
CANDIDATE = {3: 0.6, 6: 0.6, 9: 0.6}
MEMBERS = tuple(islice((f"rt-{i}" for i in count()
                        if in_canary(runtime_id=f"rt-{i}", fraction=0.1)), 3))
POLICY = CanaryPolicy(clean_windows=3, failure_limit=1, max_inconclusive=2,
                      min_shadow_tokens=100)


def _canary(engine, delta_answer):
    """Stable version 2 active, candidate 3 on the canary alias since `base`, and three
    minutes of clean token traffic from the three members from base + 1 minute."""
    base = utcnow().replace(second=0, microsecond=0) - timedelta(minutes=30)
    with session_scope(engine) as session:
        deployment = make_deployment(session, policy="canary", delta_answer=delta_answer)
        stable = publish(session=session, deployment=deployment, thresholds=STABLE,
                         reason="stable", actor="ops").version
        move_alias(session=session, deployment=deployment, alias="active", version=stable,
                   actor="ops", reason="stable")
        candidate = publish(session=session, deployment=deployment, thresholds=CANDIDATE,
                            reason="candidate", actor="ops",
                            expected_metrics={"total_exit_rate": 1 - 0.4 ** 3}).version
        start_canary(session=session, deployment=deployment, version=candidate, actor="ops",
                     now=base)
        for index, runtime_id in enumerate(MEMBERS):
            signals, matched = separable_samples(1800, seed=5 + index)
            write_traffic(session, "chat", signals, matched, start=base + timedelta(minutes=1),
                          spacing_s=0.1, version=3, thresholds=CANDIDATE, shadow_every=2,
                          runtime_id=runtime_id, request_tokens=4)
    return base


def _shadow_requests(engine, base, per_member: int, differing_per_member: int):
    """Each member's complete shadow requests at the candidate, 6 tokens each; in the first
    `differing_per_member` token 2 exits at layer 3 (0.95 > 0.6) on a mismatched prediction."""
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        for index, runtime_id in enumerate(MEMBERS):
            records = []
            for i in range(per_member):
                signals = np.full((6, 3), 0.5, dtype=np.float32)
                matched = np.ones(signals.shape, dtype=bool)
                if i < differing_per_member:
                    signals[2, 0], matched[2, 0] = 0.95, False
                records += shadow_request_records(
                    signals, matched, request_id=f"{runtime_id}-a{i}", version=3,
                    start=(base + timedelta(minutes=1, seconds=i)).timestamp())
            ingest(session=session, deployment=deployment, batches=[
                TelemetryBatch.model_validate(telemetry_batch(
                    records, deployment="chat", runtime_id=runtime_id, seq=1000 + index,
                    num_layers=FULL))])


def _evaluate(engine, at):
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        return evaluate_canary(session=session, deployment=deployment, policy=POLICY, now=at)


def test_answers_that_differ_fail_a_canary_whose_tokens_are_clean(engine, outbox):
    base = _canary(engine, delta_answer=0.1)
    _shadow_requests(engine, base, per_member=10, differing_per_member=5)
    run = _evaluate(engine, base + timedelta(minutes=2))
    assert run.status == "reverted" and run.failed_checks == 1
    check = run.checks[-1]
    assert check["verdict"] == "failed"
    assert check["tests"]["disagreement_p_value"] > POLICY.alpha  # the tokens alone pass
    answers = check["tests"]["answers"]
    assert (answers["requests"], answers["differing"], answers["witnesses"]) == (30, 15, 3)
    assert answers["p_value"] <= POLICY.alpha
    assert "15/30 canary shadow requests answer differently" in run.status_reason
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        assert aliases_of(session=session, deployment=deployment)["active"] == 2
        alert = session.scalars(select(Alert)).one()
        assert alert.kind == "canary_failed"


@pytest.mark.parametrize(("per_member", "status", "clean"), [
    (5, "paused", 0),  # 0 of 15 differ: the bound stays above 0.1, windows inconclusive
    (30, "promoted", 3),  # 0 of 90 (0 of 60 without any one witness): bound below 0.1
])
def test_answers_must_be_shown_within_the_target_before_promotion(engine, outbox, per_member,
                                                                  status, clean):
    base = _canary(engine, delta_answer=0.1)
    _shadow_requests(engine, base, per_member=per_member, differing_per_member=0)
    run = _evaluate(engine, base + timedelta(minutes=5, seconds=30))
    assert (run.status, run.clean_windows) == (status, clean)
    tested = [c for c in run.checks if "answers" in c["tests"]
              and c["tests"]["answers"]["requests"]]
    assert tested and all(c["tests"]["answers"]["differing"] == 0 for c in tested)
    if status == "paused":
        assert any("not yet shown within the target" in c["reason"] for c in tested)
    else:
        assert "upper bound" in tested[-1]["reason"] and "<= δ_answer" in tested[-1]["reason"]


def test_without_an_answer_target_tokens_alone_decide(engine, outbox):
    base = _canary(engine, delta_answer=None)
    _shadow_requests(engine, base, per_member=10, differing_per_member=5)
    run = _evaluate(engine, base + timedelta(minutes=5, seconds=30))
    assert run.status == "promoted"
    assert not any("answers" in c["tests"] for c in run.checks)
