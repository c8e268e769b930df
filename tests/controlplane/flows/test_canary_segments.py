"""The canary judges a candidate on each traffic segment whose thresholds it changes, on that
segment's rows: a candidate that changes only code's map fails on code's traffic alone, and
chat's traffic (whose map it keeps) is not what decides."""

from __future__ import annotations

from datetime import timedelta
from itertools import count, islice

from sqlalchemy.orm import Session

from controlplane.db import session_scope, utcnow
from controlplane.deployments.service import (
    aliases_of,
    get_deployment,
    in_canary,
    move_alias,
    publish,
)
from controlplane.flows.canary import CanaryPolicy, evaluate_canary, start_canary
from tests.support.calibration import make_deployment, separable_samples, write_traffic

STABLE = {3: 0.9, 6: 0.9, 9: 0.9}
# runtime ids served the canary at the deployment's canary fraction (0.1 by default)
MEMBERS = tuple(islice((f"rt-{i}" for i in count()
                        if in_canary(runtime_id=f"rt-{i}", fraction=0.1)), 3))
POLICY = CanaryPolicy(clean_windows=3, failure_limit=1, max_inconclusive=2,
                      min_shadow_tokens=100)


def _canary(engine, code_map: dict[int, float]):
    """Stable version 2 (chat and code maps = STABLE) active; candidate 3 changes code's map
    only, on the canary alias since `base`."""
    base = utcnow().replace(second=0, microsecond=0) - timedelta(minutes=30)
    with session_scope(engine) as session:
        deployment = make_deployment(session, name="assist", policy="canary")
        stable = publish(session=session, deployment=deployment, thresholds=STABLE,
                         segments={"chat": STABLE, "code": STABLE}, reason="stable",
                         actor="ops").version
        move_alias(session=session, deployment=deployment, alias="active", version=stable,
                   actor="ops", reason="stable")
        candidate = publish(session=session, deployment=deployment, thresholds=STABLE,
                            segments={"chat": STABLE, "code": code_map}, reason="candidate",
                            actor="ops").version
        start_canary(session=session, deployment=deployment, version=candidate, actor="ops",
                     now=base)
    return base


def _traffic(engine, base, *, code_map, chat_boundary: float):
    """Three canary runtimes (version 3), each serving both segments, in short requests;
    chat's layers match full depth only above `chat_boundary`."""
    with session_scope(engine) as session:
        for index, runtime_id in enumerate(MEMBERS):
            for segment, thresholds, boundary, seed in (("code", code_map, 0.5, 5),
                                                        ("chat", STABLE, chat_boundary, 6)):
                signals, matched = separable_samples(1800, seed=10 * index + seed,
                                                     mismatch_below=boundary)
                write_traffic(session, "assist", signals, matched,
                              start=base + timedelta(minutes=1), spacing_s=0.1, version=3,
                              thresholds=thresholds, shadow_every=2, request_tokens=4,
                              runtime_id=runtime_id, segment=segment)


def _evaluate(engine, at):
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="assist")
        return evaluate_canary(session=session, deployment=deployment, policy=POLICY, now=at)


def test_a_candidate_that_breaks_code_fails_on_code(engine, outbox):
    aggressive = {3: 0.3, 6: 0.3, 9: 0.3}  # code matches only above 0.5: ~20% disagree
    base = _canary(engine, aggressive)
    _traffic(engine, base, code_map=aggressive, chat_boundary=0.5)
    run = _evaluate(engine, base + timedelta(minutes=2, seconds=10))
    assert run.status == "reverted"
    [check] = run.checks
    assert check["verdict"] == "failed"
    assert check["reason"].startswith("segment code: canary disagreement")
    assert set(check["segments"]) == {"code"}  # chat's map did not change: not judged
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="assist")
        assert "canary" not in aliases_of(session=session, deployment=deployment)


def test_a_segment_whose_map_is_unchanged_does_not_decide(engine, outbox):
    safe = {3: 0.6, 6: 0.6, 9: 0.6}
    base = _canary(engine, safe)
    # chat's traffic disagrees badly under STABLE (it matches only above 0.95), but the
    # candidate keeps chat's map: judged on all traffic, it would fail
    _traffic(engine, base, code_map=safe, chat_boundary=0.95)
    run = _evaluate(engine, base + timedelta(minutes=3, seconds=10))
    assert [c["verdict"] for c in run.checks] == ["clean", "clean"]
    assert all(set(c["segments"]) == {"code"} for c in run.checks)
    assert run.status == "running"
