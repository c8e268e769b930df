"""A canary is judged by its members: the runtimes served the candidate, counted by witness.

Guards against: a runtime outside the canary group stamping forged all-matched shadow tokens with
the canary's version to push a bad candidate through; a canary promoted on the word of fewer
witnesses than the robust minimum; and one credential counting as several witnesses by
registering several runtime ids that land in the canary group.
"""

from __future__ import annotations

from datetime import timedelta
from itertools import count, islice

import numpy as np

from controlplane.calibration.learn_then_test import policy_disagreement
from controlplane.calibration.models import CanaryRun
from controlplane.db import session_scope, utcnow
from controlplane.deployments.service import (
    aliases_of,
    get_deployment,
    in_canary,
    move_alias,
    publish,
)
from controlplane.flows.canary import (
    CanaryPolicy,
    evaluate_canary,
    promote_canary,
    start_canary,
)
from controlplane.runtimes.service import record_heartbeat
from controlplane.telemetry.service import ingest, shadow_evidence
from exitplane.wire import Heartbeat
from tests.support import calibration as calibration_support
from tests.support.calibration import LAYERS, make_deployment, separable_samples, write_traffic

FRACTION = 0.1
STABLE = {3: 0.9, 6: 0.9, 9: 0.9}
GOOD = {3: 0.6, 6: 0.6, 9: 0.6}  # layers match full depth above 0.5: well within δ
BAD = {3: 0.4, 6: 0.4, 9: 0.4}  # lets out tokens between 0.4 and 0.5: ~16% disagree
MEMBERS = tuple(islice((f"rt-{i}" for i in count()
                        if in_canary(runtime_id=f"rt-{i}", fraction=FRACTION)), 3))
OUTSIDERS = tuple(islice((f"rt-{i}" for i in count()
                          if not in_canary(runtime_id=f"rt-{i}", fraction=FRACTION)), 2))
LIAR = "rt-liar"
MINUTES = 4


def _canary(engine, candidate: dict[int, float]) -> tuple[int, object]:
    """Deployment 'chat' (canary fraction 0.1) with STABLE active and `candidate` on the canary
    alias since a whole minute `MINUTES + 2` minutes ago; (candidate version, that minute)."""
    start = utcnow().replace(second=0, microsecond=0) - timedelta(minutes=MINUTES + 2)
    with session_scope(engine) as session:
        deployment = make_deployment(session, policy="auto", canary_fraction=FRACTION)
        stable = publish(session=session, deployment=deployment, thresholds=STABLE,
                         reason="stable", actor="test").version
        move_alias(session=session, deployment=deployment, alias="active", version=stable,
                   actor="test", reason="stable")
        version = publish(session=session, deployment=deployment, thresholds=candidate,
                          reason="candidate", actor="test").version
        start_canary(session=session, deployment=deployment, version=version, actor="test",
                     now=start)
    return version, start


def _serve(session, runtime_id: str, *, version: int, thresholds: dict[int, float],
           traffic, seed: int, per_minute: int = 480, forged_matched: bool = False) -> None:
    """`MINUTES` minutes of `runtime_id` applying `thresholds` at `version`, every token a
    shadow token, in requests of 8; with `forged_matched`, every exit layer reported matched."""
    signals, matched = separable_samples(MINUTES * per_minute, seed=seed, noise=0.01)
    if forged_matched:
        matched = np.ones(matched.shape, dtype=bool)
    write_traffic(session, "chat", signals, matched, start=traffic, spacing_s=60 / per_minute,
                  version=version, thresholds=thresholds, runtime_id=runtime_id,
                  request_tokens=8)


def _evaluate(engine, traffic) -> CanaryRun:
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        return evaluate_canary(session=session, deployment=deployment, policy=CanaryPolicy(),
                               now=traffic + timedelta(minutes=MINUTES, seconds=1))


def _active(engine) -> int:
    with session_scope(engine) as session:
        return aliases_of(session=session,
                          deployment=get_deployment(session=session, name="chat"))["active"]


def test_a_liar_outside_the_canary_cannot_promote_a_bad_candidate(engine, outbox):
    """A fleet of four at canary fraction 0.1: one honest runtime is the canary's only member,
    two serve the stable version, and a liar outside the canary group stamps forged all-matched
    shadow tokens with the canary's version at ten times the member's volume (pooled, they make
    the bad candidate look well within δ). Only the member counts: the candidate is reverted on its
    honest tokens, never promoted, and every check reports the liar's tokens as ignored."""
    assert not in_canary(runtime_id=LIAR, fraction=FRACTION)
    version, start = _canary(engine, BAD)
    traffic = start + timedelta(minutes=1)
    with session_scope(engine) as session:
        _serve(session, MEMBERS[0], version=version, thresholds=BAD, traffic=traffic, seed=1)
        for index, runtime_id in enumerate(OUTSIDERS):
            _serve(session, runtime_id, version=2, thresholds=STABLE, traffic=traffic,
                   seed=2 + index)
        _serve(session, LIAR, version=version, thresholds=BAD, traffic=traffic, seed=9,
               per_minute=4800, forged_matched=True)
        pooled = shadow_evidence(session=session, deployment=get_deployment(
            session=session, name="chat"), since=traffic, version=version)
        wrong, n = policy_disagreement(pooled.signals, pooled.matched,
                                       [BAD[k] for k in LAYERS])
        assert wrong / n < 0.02  # what the pooled evidence would say
    run = _evaluate(engine, traffic)
    assert run.status == "reverted", run.checks[-1]["reason"]
    assert "significantly above δ" in run.status_reason
    assert _active(engine) == 2  # the stable version
    for check in run.checks:
        assert check["tests"]["witnesses"] == 1
        assert check["canary"]["shadow_tokens"] == 480  # the member's alone
        assert check["non_members"] == {"runtimes": 1, "runtime_ids": [LIAR], "tokens": 4800,
                                        "shadow_tokens": 4800}


def test_three_member_witnesses_promote_a_good_candidate(engine, outbox):
    """Three canary members report honest evidence of a good candidate (a stable runtime beside
    them): three clean windows, each judged on three witnesses, promote it."""
    version, start = _canary(engine, GOOD)
    traffic = start + timedelta(minutes=1)
    with session_scope(engine) as session:
        for index, runtime_id in enumerate(MEMBERS):
            _serve(session, runtime_id, version=version, thresholds=GOOD, traffic=traffic,
                   seed=10 + index)
        _serve(session, OUTSIDERS[0], version=2, thresholds=STABLE, traffic=traffic, seed=19)
    run = _evaluate(engine, traffic)
    assert run.status == "promoted", run.checks[-1]["reason"]
    assert [c["verdict"] for c in run.checks] == ["clean"] * 3
    assert all(c["tests"]["witnesses"] == 3 and c["non_members"]["runtimes"] == 0
               for c in run.checks)
    assert _active(engine) == version


def test_two_member_witnesses_pause_instead_of_promoting(engine, outbox):
    """Two canary members report honest evidence of a good candidate: a window that would be
    clean rests on fewer witnesses than the robust minimum, so it is not counted as clean and
    the canary pauses at once for an operator, who can still promote it."""
    version, start = _canary(engine, GOOD)
    traffic = start + timedelta(minutes=1)
    with session_scope(engine) as session:
        for index, runtime_id in enumerate(MEMBERS[:2]):
            _serve(session, runtime_id, version=version, thresholds=GOOD, traffic=traffic,
                   seed=20 + index)
    run = _evaluate(engine, traffic)
    assert (run.status, run.clean_windows, run.inconclusive_windows) == ("paused", 0, 1)
    [check] = run.checks
    assert check["verdict"] == "inconclusive" and check["tests"]["witnesses"] == 2
    assert "only 2 canary witnesses" in run.status_reason
    assert "exitplane canary promote chat" in run.status_reason
    assert _active(engine) == 2  # the stable version
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        paused = session.get(CanaryRun, run.id)
        promote_canary(session=session, deployment=deployment, run=paused, actor="ops",
                       reason="checked the two runtimes by hand")
    assert _active(engine) == version


def test_one_credential_behind_three_member_ids_is_one_witness(engine, outbox, monkeypatch):
    """One token posts under three runtime ids that all land in the canary group: its word is
    one witness's, so a window clean on it pauses the canary instead of counting toward a
    promotion."""
    version, start = _canary(engine, GOOD)
    traffic = start + timedelta(minutes=1)

    def ingest_as_one_token(*, session, deployment, batches):
        return ingest(session=session, deployment=deployment, batches=batches,
                      witnesses=["token:7"] * len(batches))

    monkeypatch.setattr(calibration_support, "ingest", ingest_as_one_token)
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        for index, runtime_id in enumerate(MEMBERS):
            # each runtime says it applies the canary: a token's evidence counts at versions
            # its runtimes applied
            record_heartbeat(session=session, deployment=deployment, beat=Heartbeat(
                runtime_id=runtime_id, applied_version=version))
            _serve(session, runtime_id, version=version, thresholds=GOOD, traffic=traffic,
                   seed=30 + index)
    run = _evaluate(engine, traffic)
    assert run.status == "paused" and run.clean_windows == 0
    assert run.checks[0]["tests"]["witnesses"] == 1
    assert "only 1 canary witness " in run.status_reason

