"""Witnesses are credentials: a runtime id belongs to the token that registered it, and the
fleet's robust rules count tokens, not the ids they name.

Pins: another token's heartbeat, telemetry or leave under a registered id is refused (403) on
the route and on the event-loop fast path; telemetry registers a new id under the runtime caps;
a token cannot frame another runtime with a foreign lineage; an id whose token was revoked can
be registered again; every id of one token is one witness in the evidence; evidence a token
posts long after its own timestamp does not count; a first calibration from never-exit decided
by fewer witnesses than the robust minimum waits for an operator; evidence stamped with a
version its runtime never applied does not count; the exit-rate rise a
promotion is bounded by is read on the median witness as well.
"""

from __future__ import annotations

import random
import time
from datetime import timedelta

import numpy as np
import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controlplane.auth.models import ApiToken
from controlplane.calibration import service as calibration
from controlplane.calibration.models import CalibrationJob
from controlplane.calibration.promotion import _expected_exit_rate
from controlplane.calibration.segments import calibrate_segments
from controlplane.db import session_scope, utcnow
from controlplane.deployments.models import ThresholdSet
from controlplane.deployments.service import get_deployment
from controlplane.flows import recalibration
from controlplane.runtimes.lineage import mismatched_runtime_ids
from controlplane.runtimes.models import Runtime
from controlplane.telemetry.models import ShadowSampleRow
from controlplane.telemetry.service import shadow_evidence
from tests.support.batches import random_batch
from tests.support.calibration import LAYERS, make_deployment, separable_samples, write_traffic
from tests.support.deployments import deploy_for_telemetry, issue_runtime_token

BEATS = "/v1/deployments/{}/heartbeats"


def _applies(client, auth, runtime_id: str, version: int) -> None:
    """A heartbeat of `runtime_id` saying it applies `version`."""
    beat = client.post(BEATS.format("chat"), headers=auth,
                       json={"runtime_id": runtime_id, "applied_version": version})
    assert beat.status_code == 200, beat.text


def _owner(engine, runtime_id: str) -> int | None:
    with Session(engine) as session:
        return session.scalar(select(Runtime.token_id).where(Runtime.runtime_id == runtime_id))


@pytest.mark.parametrize("fast_path", [True, False])
def test_a_token_reports_only_under_the_runtime_ids_it_registered(serve, tokens, engine,
                                                                  fast_path):
    """Token A registers rt-a by its first heartbeat; token B's heartbeat, telemetry and leave
    under rt-a are refused with 403 (twice: the second may come from a process cache), while
    A keeps reporting and an operator may still remove it."""
    client = serve(telemetry_fast_path=fast_path)
    deploy_for_telemetry(client, tokens, engine)
    a_id, a = issue_runtime_token(engine)
    _, b = issue_runtime_token(engine)
    assert client.post(BEATS.format("chat"), headers=a,
                       json={"runtime_id": "rt-a"}).status_code == 200
    assert _owner(engine, "rt-a") == a_id
    rng = random.Random(7)
    for _ in range(2):
        beat = client.post(BEATS.format("chat"), headers=b, json={"runtime_id": "rt-a"})
        assert beat.status_code == 403, beat.text
        assert "registered by another token" in beat.json()["detail"]
        posted = client.post("/v1/telemetry", headers=b,
                             json=random_batch(rng, n=10, runtime_id="rt-a"))
        assert posted.status_code == 403, posted.text
        assert "registered by another token" in posted.json()["detail"]
    left = client.post("/v1/deployments/chat/runtimes/rt-a/leave", headers=b)
    assert left.status_code == 403, left.text
    assert client.post("/v1/telemetry", headers=a,
                       json=random_batch(rng, n=10, runtime_id="rt-a")).status_code == 202
    assert client.post(BEATS.format("chat"), headers=a,
                       json={"runtime_id": "rt-a"}).status_code == 200
    assert _owner(engine, "rt-a") == a_id
    operator = tokens.headers(tokens.operator)
    assert client.delete("/v1/deployments/chat/runtimes/rt-a",
                         headers=operator).status_code == 200


def test_telemetry_registers_a_new_runtime_id_under_the_caps(serve, tokens, engine):
    """A batch under an id nobody registered registers it to the posting token, counted
    against the caps as a first heartbeat is: with one runtime per token, a second made-up id
    is refused (409), so one token cannot report as many runtimes without heartbeats."""
    client = serve(max_runtimes_per_token=1)
    deploy_for_telemetry(client, tokens, engine)
    token_id, auth = issue_runtime_token(engine)
    rng = random.Random(3)
    first = client.post("/v1/telemetry", headers=auth, json=random_batch(rng, runtime_id="rt-x"))
    assert first.status_code == 202, first.text
    assert _owner(engine, "rt-x") == token_id
    second = client.post("/v1/telemetry", headers=auth, json=random_batch(rng, runtime_id="rt-y"))
    assert second.status_code == 409, second.text
    assert _owner(engine, "rt-y") is None
    again = client.post("/v1/telemetry", headers=auth, json=random_batch(rng, runtime_id="rt-x"))
    assert again.status_code == 202


def test_a_token_cannot_frame_another_runtime_with_a_foreign_lineage(serve, tokens, engine):
    """B posts a batch under A's runtime id naming other exit heads: refused before its
    lineage is read, so A is never marked as serving other heads."""
    client = serve()
    deploy_for_telemetry(client, tokens, engine)
    with Session(engine) as session:
        get_deployment(session=session, name="chat").head_digest = "sha256:" + "a" * 64
        session.commit()
    _, a = issue_runtime_token(engine)
    _, b = issue_runtime_token(engine)
    assert client.post(BEATS.format("chat"), headers=a, json={
        "runtime_id": "rt-a", "head_digest": "sha256:" + "a" * 64}).status_code == 200
    framed = random_batch(random.Random(5), n=5, runtime_id="rt-a")
    framed["head_digest"] = "sha256:" + "b" * 64
    assert client.post("/v1/telemetry", headers=b, json=framed).status_code == 403
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        assert mismatched_runtime_ids(session=session, deployment_id=deployment.id) == set()


def test_a_revoked_token_s_runtime_ids_may_be_registered_again(serve, tokens, engine):
    """Rotation: once the old token is revoked, the runtime reports under its id with the new
    token, which then owns it."""
    client = serve()
    deploy_for_telemetry(client, tokens, engine)
    old_id, old = issue_runtime_token(engine)
    new_id, new = issue_runtime_token(engine)
    assert client.post(BEATS.format("chat"), headers=old,
                       json={"runtime_id": "rt-a"}).status_code == 200
    assert client.post(BEATS.format("chat"), headers=new,
                       json={"runtime_id": "rt-a"}).status_code == 403
    with Session(engine) as session:
        session.get(ApiToken, old_id).revoked_at = utcnow()
        session.commit()
    assert client.post("/v1/telemetry", headers=new, json=random_batch(
        random.Random(2), runtime_id="rt-a")).status_code == 202
    assert _owner(engine, "rt-a") == new_id


def test_every_runtime_id_of_one_token_is_one_witness(serve, tokens, engine):
    """Three ids posted by one token are one witness in the evidence every decision reads;
    the two other tokens' ids are a witness each."""
    client = serve()
    deploy_for_telemetry(client, tokens, engine)
    rng = random.Random(11)
    sybil_id, sybil = issue_runtime_token(engine)
    for runtime_id in ("rt-s1", "rt-s2", "rt-s3"):
        _applies(client, sybil, runtime_id, 2)
        assert client.post("/v1/telemetry", headers=sybil, json=random_batch(
            rng, shadow_rate=1.0, runtime_id=runtime_id)).status_code == 202
    honest = []
    for runtime_id in ("rt-h1", "rt-h2"):
        token_id, auth = issue_runtime_token(engine)
        honest.append(token_id)
        _applies(client, auth, runtime_id, 2)
        assert client.post("/v1/telemetry", headers=auth, json=random_batch(
            rng, shadow_rate=1.0, runtime_id=runtime_id)).status_code == 202
    with Session(engine) as session:
        found = shadow_evidence(session=session, deployment=get_deployment(
            session=session, name="chat"), since=utcnow() - timedelta(hours=1))
    assert set(found.runtimes) == {"rt-s1", "rt-s2", "rt-s3", "rt-h1", "rt-h2"}
    assert set(found.witnesses) == {f"token:{sybil_id}", *(f"token:{i}" for i in honest)}
    by_runtime = dict(zip(found.runtimes, found.witnesses, strict=True))
    assert {by_runtime[r] for r in ("rt-s1", "rt-s2", "rt-s3")} == {f"token:{sybil_id}"}


def test_evidence_posted_long_after_its_timestamp_does_not_count(serve, tokens, engine):
    """Shadow tokens a runtime token stamps two hours before it posts them are stored, but no
    decision reads them (EXITPLANE_EVIDENCE_MAX_DELAY_S, an hour); fresh ones are read."""
    client = serve()
    deploy_for_telemetry(client, tokens, engine)
    _, auth = issue_runtime_token(engine)
    _applies(client, auth, "rt-a", 2)
    rng = random.Random(13)
    old = random_batch(rng, n=20, shadow_rate=1.0, runtime_id="rt-a", ts=time.time() - 7200)
    fresh = random_batch(rng, n=20, shadow_rate=1.0, runtime_id="rt-a")
    for batch in (old, fresh):
        assert client.post("/v1/telemetry", headers=auth, json=batch).status_code == 202
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        found = shadow_evidence(session=session, deployment=deployment,
                                since=utcnow() - timedelta(hours=3))
        stored = session.scalar(select(func.count()).select_from(ShadowSampleRow))
    assert stored == 40  # both stored
    assert len(found.requests) == 20  # only the fresh ones count


def test_evidence_stamped_with_a_version_its_runtime_never_applied_does_not_count(
        serve, tokens, engine):
    """A runtime token's shadow tokens stamped with version 2 count once its runtime's
    heartbeat says it applies version 2 (and version 0, the built-in set, always does): a
    token cannot slip evidence under a version its runtime never served."""
    client = serve()
    deploy_for_telemetry(client, tokens, engine)
    _, auth = issue_runtime_token(engine)
    batch = random_batch(random.Random(17), n=40, shadow_rate=1.0, runtime_id="rt-a")
    assert client.post("/v1/telemetry", headers=auth, json=batch).status_code == 202
    stamped = [record["threshold_version"] for record in batch["records"]]

    def counted() -> int:
        with Session(engine) as session:
            return len(shadow_evidence(session=session, deployment=get_deployment(
                session=session, name="chat"), since=utcnow() - timedelta(hours=1)).requests)

    assert counted() == stamped.count(0) < len(stamped)
    _applies(client, auth, "rt-a", 2)
    client.app.state.heartbeats.flush()
    assert counted() == len(stamped)


def _calibrate_from_never_exit(engine, runtimes: list[str]) -> CalibrationJob:
    """A deployment under policy auto whose active set never exits, calibrated on shadow
    tokens written by `runtimes` (a witness each)."""
    start = utcnow() - timedelta(minutes=30)
    with session_scope(engine) as session:
        make_deployment(session, policy="auto")
        for index, runtime_id in enumerate(runtimes):
            signals, matched = separable_samples(3000 // len(runtimes) // 8 * 8,
                                                 seed=40 + index, mismatch_below=0.7)
            write_traffic(session, "chat", signals, matched, start=start, spacing_s=0.2,
                          runtime_id=runtime_id, request_tokens=8)
        deployment = get_deployment(session=session, name="chat")
        job, _ = calibration.request_calibration(session=session, deployment=deployment,
                                                 actor="test", since=start, enqueue=False)
        job_id = job.id
    with session_scope(engine) as session:
        job = recalibration.run_calibration(
            session=session, job=session.get(CalibrationJob, job_id),
            policy=calibration.CalibrationPolicy(min_samples_per_layer=500, seed=0))
        session.expunge(job)
    return job


@pytest.mark.parametrize(("runtimes", "promotion"), [
    (["rt-1", "rt-2"], "awaiting_approval"), (["rt-1", "rt-2", "rt-3"], "active")])
def test_a_first_calibration_on_few_witnesses_waits_for_an_operator(engine, runtimes,
                                                                    promotion):
    """From never-exit, a set certified on the evidence of fewer witnesses than the robust
    minimum (3) waits for approval under policy auto; three witnesses promote it."""
    job = _calibrate_from_never_exit(engine, runtimes)
    assert job.status == "succeeded", job.status_reason
    assert job.promotion == promotion, job.summary.get("promotion_hold")
    if promotion == "awaiting_approval":
        hold = job.summary["promotion_hold"]
        assert "2 witness(es)" in hold and "waits for an operator" in hold
    else:
        assert not (job.summary or {}).get("promotion_hold"), job.summary


def test_the_exit_rate_a_promotion_is_bounded_by_is_read_on_the_median_witness_too():
    """A calibration whose test split a minority shaped to show a low exit rate still
    carries its median witness's: the bound reads the larger."""
    shaped = ThresholdSet(thresholds={str(k): 0.0 for k in LAYERS}, segments=None,
                          expected_metrics={"total_exit_rate": 0.75,
                                            "median_witness_exit_rate": 1.0})
    assert _expected_exit_rate(shaped, "default") == 1.0
    plain = ThresholdSet(thresholds={str(k): 0.5 for k in LAYERS}, segments=None,
                         expected_metrics={"total_exit_rate": 0.4})
    assert _expected_exit_rate(plain, "default") == pytest.approx(0.4)
    assert np.isclose(_expected_exit_rate(ThresholdSet(
        thresholds={str(k): 1.0 for k in LAYERS}, segments=None, expected_metrics={}),
        "default"), 0.0)


def test_a_small_segment_vouched_for_by_one_witness_keeps_never_exit():
    """A segment too small for its own calibration takes the pooled set only when the
    fleet's witnesses vouch for it: code traffic from one witness alone (forging agreement)
    keeps never-exit in a fleet of three, while the same segment from three witnesses is
    checked."""
    rng = np.random.default_rng(5)
    honest, matched = separable_samples(3000, seed=21, mismatch_below=0.5)
    witnesses = np.array([f"token:{i % 3}" for i in range(3000)])
    code = rng.random((400, len(LAYERS)))

    def decide(code_witnesses: np.ndarray):
        return calibrate_segments(
            signals=np.concatenate([honest, code]),
            matched=np.concatenate([matched, np.ones(code.shape, dtype=bool)]),
            segments=np.array(["default"] * 3000 + ["code"] * 400),
            requests=np.array([f"r{i // 8}" for i in range(3400)]),
            runtimes=np.concatenate([witnesses, code_witnesses]),
            exit_layers=LAYERS, num_layers=12, delta=0.05, epsilon=0.1, seed=0)

    alone = decide(np.array(["token:9"] * 400)).segments["code"]
    assert alone.source == "conservative"
    assert "1 witness(es)" in alone.reason
    fleet = decide(np.array([f"token:{i % 3}" for i in range(400)])).segments["code"]
    assert "witness(es)" not in fleet.reason
