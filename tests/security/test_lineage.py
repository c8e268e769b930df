"""Lineage: a runtime serving other exit heads (or another model revision) than its deployment
names is served and shown, but its evidence never calibrates or pages on quality; a runtime
refuses a threshold set made for other heads; a runtime that reports no lineage keeps working;
`runtime_mismatch` names the runtime and what differs.

Without lineage, one runtime that loaded other heads (or lies about its match checks) feeds the
fleet's calibration and quality tests like every honest one."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from controlplane.alerts.models import Alert
from controlplane.calibration import service as calibration
from controlplane.calibration.models import CalibrationJob
from controlplane.db import session_scope, utcnow
from controlplane.deployments.models import Deployment
from controlplane.deployments.service import get_deployment, move_alias, publish
from controlplane.drift.service import DriftOptions, check_deployment
from controlplane.flows import recalibration
from controlplane.flows.canary import CanaryPolicy, evaluate_canary, start_canary
from controlplane.runtimes.lineage import check_lineage, mismatched_runtime_ids
from controlplane.runtimes.models import Runtime, RuntimeOutlier
from controlplane.runtimes.service import record_heartbeat
from controlplane.telemetry.service import ingest
from exitplane.client.thresholds import ThresholdClient
from exitplane.wire import Heartbeat, TelemetryBatch
from tests.support.alerts import Phase, send_traffic
from tests.support.alerts import make_deployment as make_drift_deployment
from tests.support.batches import telemetry_batch
from tests.support.calibration import (
    FULL,
    LAYERS,
    make_deployment,
    separable_samples,
    write_traffic,
)
from tests.support.runtime_link import DEPLOYMENT, EXIT_LAYERS
from tests.support.runtime_link import publish as publish_over_http
from tests.support.waiting import patient_get, wait_until

HEADS = "a" * 64  # the deployment's exit heads
OTHER_HEADS = "b" * 64
MODEL = "rev-1"
HONEST = ("rt-1", "rt-2", "rt-3")
POLICY = calibration.CalibrationPolicy(min_samples_per_layer=500, seed=0)
FAST = {"long_poll_s": 0.2, "heartbeat_interval_s": 0.2, "backoff_initial_s": 0.05,
        "backoff_max_s": 0.5}


def _beat(session: Session, deployment, runtime_id: str, *, heads: str | None = HEADS,
          model: str | None = MODEL) -> Runtime:
    return record_heartbeat(session=session, deployment=deployment, beat=Heartbeat(
        runtime_id=runtime_id, applied_version=1, head_digest=heads, model_revision=model))


def _seed_fleet(engine, name: str, *, liar_heads: str | None) -> None:
    """Three honest runtimes' shadow tokens (known separable labels) and, unless `liar_heads`
    is None, a fourth runtime reporting `liar_heads` whose shadow tokens all match at 0.99."""
    start = utcnow() - timedelta(minutes=30)
    with session_scope(engine) as session:
        deployment = make_deployment(session, name=name, head_digest=HEADS,
                                     model_revision=MODEL)
        for index, runtime_id in enumerate(HONEST):
            _beat(session, deployment, runtime_id)
            signals, matched = separable_samples(1500, seed=10 + index)
            write_traffic(session, name, signals, matched, start=start, runtime_id=runtime_id)
        if liar_heads is not None:
            _beat(session, deployment, "rt-liar", heads=liar_heads)
            signals = np.full((3000, len(LAYERS)), 0.99, dtype=np.float32)
            write_traffic(session, name, signals, np.ones_like(signals, dtype=bool),
                          start=start, runtime_id="rt-liar")


def _certified(engine, name: str) -> dict:
    """Run a calibration job on the deployment's last hour; what it certified."""
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name=name)
        job, _ = calibration.request_calibration(
            session=session, deployment=deployment, actor="test", policy=POLICY,
            since=utcnow() - timedelta(hours=1), trigger="manual")
        job_id = job.id
    with session_scope(engine) as session:
        calibration.start_job(session=session, job=session.get(CalibrationJob, job_id))
    with session_scope(engine) as session:
        recalibration.run_calibration(session=session, job=session.get(CalibrationJob, job_id),
                                      policy=POLICY)
    with Session(engine) as session:
        job = session.get(CalibrationJob, job_id)
        return {"status": job.status, "thresholds": (job.summary or {}).get("thresholds"),
                "samples": (job.summary or {}).get("samples")}


@pytest.mark.slow
def test_a_runtime_on_other_heads_cannot_calibrate(engine, outbox):
    _seed_fleet(engine, "honest", liar_heads=None)
    _seed_fleet(engine, "mixed", liar_heads=OTHER_HEADS)
    _seed_fleet(engine, "trusted", liar_heads=HEADS)  # the same liar on the deployment's heads
    with Session(engine) as session:
        mixed = get_deployment(session=session, name="mixed")
        assert mismatched_runtime_ids(session=session, deployment_id=mixed.id) == {"rt-liar"}
        # Stored (and shown) all the same: every shadow token of the four runtimes is kept.
        assert {r.runtime_id for r in session.scalars(select(Runtime).where(
            Runtime.deployment_id == mixed.id))} == {*HONEST, "rt-liar"}
    honest = _certified(engine, "honest")
    assert honest["status"] == "succeeded" and honest["thresholds"]
    # Its shadow tokens leave what calibration certifies exactly as without them ...
    assert _certified(engine, "mixed") == honest
    # ... and on the deployment's heads the same tokens are screened out by the calibration
    # itself (its whole window's outlier screen), not by lineage.
    assert _certified(engine, "trusted") == honest
    with Session(engine) as session:
        set_aside = {(deployment.name, outlier.runtime_id) for outlier, deployment in
                     session.execute(select(RuntimeOutlier, Deployment).join(
                         Deployment, Deployment.id == RuntimeOutlier.deployment_id))}
    assert set_aside == {("trusted", "rt-liar")}


@pytest.mark.slow
def test_a_runtime_on_other_heads_cannot_page_on_quality(session: Session, tmp_path, outbox):
    now = utcnow().replace(second=30, microsecond=0)
    start = (now - timedelta(minutes=10)).replace(second=0)
    deployment = make_drift_deployment(session, activated_at=start, delta=0.02)
    deployment.head_digest = HEADS
    session.flush()
    _beat(session, deployment, "rt-1")
    send_traffic(session, deployment, start=start, seed=5, runtime_id="rt-1",
                 phases=[Phase(10, (0.25, 0.4, 0.3), shadow_rate=0.2, mismatch_rate=0.0)])
    _beat(session, deployment, "rt-other", heads=OTHER_HEADS)
    send_traffic(session, deployment, start=start, seed=4, runtime_id="rt-other",
                 phases=[Phase(10, (0.25, 0.4, 0.3), shadow_rate=0.2, mismatch_rate=0.3)])
    options = DriftOptions()
    result = check_deployment(session=session, deployment=deployment, options=options,
                              keep_reports=True, now=now)
    assert [a.kind for a in result.fired if a.kind == "quality_regression"] == []

    # The same disagreeing runtime on the deployment's heads pages.
    _beat(session, deployment, "rt-other", heads=HEADS)
    session.execute(update(Runtime).values(lineage_mismatch_at=None))
    result = check_deployment(session=session, deployment=deployment, options=options,
                              keep_reports=True, now=now)
    assert [a.kind for a in result.fired if a.kind == "quality_regression"] == [
        "quality_regression"]


STABLE = {3: 0.9, 6: 0.9, 9: 0.9}
CANDIDATE = {3: 0.6, 6: 0.6, 9: 0.6}  # holds δ on the separable samples


def _canary_verdict(engine, name: str, *, other_heads: str) -> dict:
    """Candidate v3 on the canary alias: an honest canary runtime, a stable one, and a canary
    runtime reporting `other_heads` whose shadow tokens all disagree with full depth; the run
    after one minute of that traffic."""
    base = utcnow().replace(second=0, microsecond=0) - timedelta(minutes=30)
    signals, matched = separable_samples(600, seed=5)
    with session_scope(engine) as session:
        # every runtime a canary member: the canary judges its members only
        deployment = make_deployment(session, name=name, policy="canary", head_digest=HEADS,
                                     model_revision=MODEL, canary_fraction=1.0)
        stable = publish(session=session, deployment=deployment, thresholds=STABLE,
                         reason="stable", actor="ops").version
        move_alias(session=session, deployment=deployment, alias="active", version=stable,
                   actor="ops", reason="stable")
        candidate = publish(session=session, deployment=deployment, thresholds=CANDIDATE,
                            reason="candidate", actor="ops",
                            expected_metrics={"total_exit_rate": 1 - 0.4 ** 3}).version
        start_canary(session=session, deployment=deployment, version=candidate, actor="ops",
                     now=base)
        _beat(session, deployment, "rt-canary")
        _beat(session, deployment, "rt-stable")
        _beat(session, deployment, "rt-other", heads=other_heads)
        for runtime_id, version, thresholds, labels in (
                ("rt-canary", 3, CANDIDATE, matched), ("rt-stable", 2, STABLE, matched),
                ("rt-other", 3, CANDIDATE, np.zeros_like(matched))):
            write_traffic(session, name, signals, labels, start=base + timedelta(minutes=1),
                          spacing_s=0.1, version=version, thresholds=thresholds,
                          shadow_every=2, runtime_id=runtime_id, request_tokens=4)
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name=name)
        run = evaluate_canary(session=session, deployment=deployment, now=base + timedelta(
            minutes=2), policy=CanaryPolicy(clean_windows=3, failure_limit=1,
                                            max_inconclusive=2, min_shadow_tokens=100))
        return {"status": run.status, "failed_checks": run.failed_checks,
                "verdicts": [check["verdict"] for check in run.checks]}


@pytest.mark.slow
def test_a_runtime_on_other_heads_cannot_judge_a_canary(engine, outbox):
    # Its disagreeing shadow tokens fail nothing: the one honest canary witness left is too
    # few to promote on, so the canary waits for an operator ...
    assert _canary_verdict(engine, "mixed", other_heads=OTHER_HEADS) == {
        "status": "paused", "failed_checks": 0, "verdicts": ["inconclusive"]}
    # ... where the same tokens from a runtime on the deployment's heads revert it.
    judged = _canary_verdict(engine, "trusted", other_heads=HEADS)
    assert judged["status"] == "reverted" and judged["failed_checks"] == 1


def _batch(deployment_name: str, runtime_id: str, **lineage) -> TelemetryBatch:
    ts = utcnow().timestamp()
    return TelemetryBatch.model_validate(telemetry_batch(
        [{"threshold_version": 1, "request_id": "r1", "position": 0, "exit_layer": FULL,
          "signal_value": 0.5, "latency_us": 10, "ts": ts}],
        deployment=deployment_name, runtime_id=runtime_id, num_layers=FULL, **lineage))


def test_what_makes_a_runtime_mismatched(session: Session, outbox):
    deployment = make_deployment(session, head_digest=HEADS, model_revision=MODEL)
    for runtime_id in ("rt-same", "rt-unknown", "rt-model", "rt-heads", "rt-batch", "rt-back"):
        _beat(session, deployment, runtime_id, heads=None, model=None)
    _beat(session, deployment, "rt-same")
    _beat(session, deployment, "rt-model", model="rev-2")
    _beat(session, deployment, "rt-heads", heads=OTHER_HEADS)
    # Telemetry alone: the heartbeats say nothing, a batch names other heads.
    ingest(session=session, deployment=deployment, batches=[
        _batch("chat", "rt-batch", head_digest=OTHER_HEADS),
        _batch("chat", "rt-same", head_digest=HEADS, model_revision=MODEL),
        _batch("chat", "rt-unknown")])
    # Reported other heads, then the deployment's: still mismatched within the window.
    _beat(session, deployment, "rt-back", heads=OTHER_HEADS)
    _beat(session, deployment, "rt-back")
    mismatched = {"rt-model", "rt-heads", "rt-batch", "rt-back"}
    assert mismatched_runtime_ids(session=session, deployment_id=deployment.id) == mismatched
    row = session.scalars(select(Runtime).where(Runtime.runtime_id == "rt-batch")).one()
    assert row.mismatch_head_digest == OTHER_HEADS and row.head_digest is None

    # Past the evidence window only what a runtime reports now counts.
    session.execute(update(Runtime).values(lineage_mismatch_at=utcnow() - timedelta(days=30)))
    assert mismatched_runtime_ids(session=session, deployment_id=deployment.id) == {
        "rt-model", "rt-heads"}
    # A deployment that names nothing compares nothing.
    deployment.head_digest, deployment.model_revision = "", ""
    session.flush()
    assert mismatched_runtime_ids(session=session, deployment_id=deployment.id) == set()


def test_runtime_mismatch_names_the_runtime_and_what_differs(session: Session, outbox):
    deployment = make_deployment(session, head_digest=HEADS, model_revision=MODEL)
    _beat(session, deployment, "rt-good")
    _beat(session, deployment, "rt-unknown", heads=None, model=None)
    _beat(session, deployment, "rt-bad", heads=OTHER_HEADS)
    result = check_lineage(session=session, deployment=deployment, clear_after_s=0)
    [alert] = result.fired
    assert alert.kind == "runtime_mismatch" and alert.severity == "warning"
    assert "rt-bad: head_digest bbbbbbbbbbbb" in alert.summary
    assert "rt-good" not in alert.summary and "rt-unknown" not in alert.summary
    [listed] = alert.evidence["runtimes"]
    assert listed["runtime_id"] == "rt-bad"
    assert listed["differs"] == {"head_digest": {"reported": OTHER_HEADS, "deployment": HEADS}}

    # Back on the deployment's heads and past the window: the alert resolves.
    _beat(session, deployment, "rt-bad")
    session.execute(update(Runtime).values(lineage_mismatch_at=utcnow() - timedelta(days=30)))
    result = check_lineage(session=session, deployment=deployment, clear_after_s=0)
    assert [a.id for a in result.resolved] == [alert.id]
    assert session.get(Alert, alert.id).status == "resolved"


class HeadsRuntime:
    """A runtime other than ours that serves exit heads `head_digest` (None: unknown)."""

    applies_segments = True

    def __init__(self, runtime_id: str, head_digest: str | None) -> None:
        self.exit_layers = list(EXIT_LAYERS)
        self.runtime_id = runtime_id
        self.head_digest = head_digest
        self.model_revision = MODEL if head_digest else None
        self.applied = []

    def set_thresholds(self, threshold_set) -> None:
        self.applied.append(threshold_set)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_runtime_refuses_a_set_made_for_other_heads(control_plane, operator,
                                                      runtime_token):
    patched = operator.patch(f"/v1/deployments/{DEPLOYMENT}",
                             json={"head_digest": HEADS, "model_revision": MODEL})
    assert patched.status_code == 200, patched.text
    assert patched.json()["model_revision"] == MODEL
    version = publish_over_http(operator, {2: 0.9, 4: 0.8})
    served = operator.get(f"/v1/deployments/{DEPLOYMENT}/threshold-sets/{version}").json()
    assert served["head_digest"] == HEADS  # a set that can exit names the heads
    runtimes = {"rt-same": HEADS, "rt-other": OTHER_HEADS, "rt-unknown": None}
    clients = {}
    try:
        for runtime_id, heads in runtimes.items():
            clients[runtime_id] = ThresholdClient(
                HeadsRuntime(runtime_id, heads), base_url=control_plane.url,
                deployment=DEPLOYMENT, token=runtime_token, **FAST).start()
            assert clients[runtime_id].wait_ready(20)
        # The deployment's heads and unknown heads apply it; other heads refuse it and run the
        # built-in never-exit set instead, saying why in their heartbeat.
        assert clients["rt-same"].applied.version == version
        assert clients["rt-unknown"].applied.version == version
        other = clients["rt-other"]
        wait_until(lambda: other.counters["refused"] >= 1, message="the set refused")
        assert other.applied.version == 0 and other.engine.applied[-1].version == 0
        assert f"made for exit heads {HEADS}" in other.error

        def listed() -> dict:
            return {row["runtime_id"]: row
                    for row in patient_get(operator,
                                           f"/v1/deployments/{DEPLOYMENT}/runtimes").json()}

        wait_until(lambda: "made for exit heads" in (listed().get("rt-other", {}).get("error")
                                                      or ""), message="the refusal reported")
        rows = listed()
        assert rows["rt-other"]["head_digest"] == OTHER_HEADS
        assert rows["rt-same"]["head_digest"] == HEADS
        assert rows["rt-same"]["model_revision"] == MODEL
        assert rows["rt-unknown"]["head_digest"] is None
        assert rows["rt-other"]["lineage_mismatch_at"] is not None
        assert rows["rt-same"]["lineage_mismatch_at"] is None

        # The conservative set never exits: it fits any heads, so the fallback reaches all.
        moved = operator.put(f"/v1/deployments/{DEPLOYMENT}/aliases/active",
                             json={"version": 1, "reason": "fallback"})
        assert moved.status_code == 200, moved.text
        wait_until(lambda: other.applied.version == 1 and other.error is None,
                   message="the never-exit set applied on other heads")
    finally:
        for client in clients.values():
            client.stop()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_lineage_is_checked_where_it_enters(control_plane, operator,
                                            runtime_token):
    bad = operator.post("/v1/deployments", json={
        "name": "bad-heads", "model_ref": "m", "num_layers": 6, "head_digest": "no spaces"})
    assert bad.status_code == 422 and "head_digest" in bad.text
    beat = operator.post(f"/v1/deployments/{DEPLOYMENT}/heartbeats",
                         headers={"Authorization": f"Bearer {runtime_token}"},
                         json={"runtime_id": "rt-x", "head_digest": "x" * 72})
    assert beat.status_code == 422 and "head_digest" in beat.text
    with pytest.raises(ValueError, match="model_revision"):
        ThresholdClient(HeadsRuntime("rt-y", None), base_url=control_plane.url,
                        deployment=DEPLOYMENT, token=runtime_token, model_revision="a b")


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("options", [{}, {"raw_sample_rate": 0.5, "exit_layers": EXIT_LAYERS,
                                          "aggregate_interval_s": 0.1}],
                         ids=["records", "interval"])
def test_the_shipper_carries_the_lineage_it_is_given(control_plane, operator,
                                                     runtime_token, engine, tmp_path,
                                                     options):
    from exitplane.client.shipper import TelemetryShipper
    from exitplane.wire import TokenRecord
    from tests.support.runtime_link import NUM_LAYERS

    patched = operator.patch(f"/v1/deployments/{DEPLOYMENT}", json={"head_digest": HEADS})
    assert patched.status_code == 200, patched.text
    # Its heartbeats say nothing; its telemetry names other heads.
    beat = operator.post(f"/v1/deployments/{DEPLOYMENT}/heartbeats", json={"runtime_id": "rt-s"},
                         headers={"Authorization": f"Bearer {runtime_token}"})
    assert beat.status_code == 200, beat.text
    shipper = TelemetryShipper(base_url=control_plane.url, token=runtime_token,
                               deployment=DEPLOYMENT, runtime_id="rt-s", num_layers=NUM_LAYERS,
                               spool_dir=tmp_path / "spool", batch_interval_s=0.05, fsync=False,
                               head_digest=OTHER_HEADS, model_revision=MODEL, **options).start()
    try:
        for position in range(20):
            assert shipper.submit(TokenRecord(
                threshold_version=0, request_id="r1", position=position, exit_layer=NUM_LAYERS,
                signal_value=None, latency_us=5, ts=utcnow().timestamp()))
        assert shipper.flush(30)
    finally:
        shipper.close()
    sent = shipper.counters["sent_batches"] + shipper.counters["sent_aggregate_batches"]
    assert sent >= 1 and shipper.counters["rejected_batches"] == 0
    with Session(engine) as session:
        deployment = get_deployment(session=session, name=DEPLOYMENT)
        assert mismatched_runtime_ids(session=session, deployment_id=deployment.id) == {"rt-s"}
        row = session.scalars(select(Runtime).where(Runtime.runtime_id == "rt-s")).one()
        assert (row.mismatch_head_digest, row.mismatch_model_revision) == (OTHER_HEADS, MODEL)
        assert row.head_digest is None  # what its heartbeats say: unknown
