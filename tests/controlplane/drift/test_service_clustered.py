"""Drift detection on request-clustered traffic, rollups and shadow samples written by
the real ingestion: stationary traffic whose requests differ stays quiet, a real shift is still
found, distribution drift alone is info until it persists, an exit-rate spike whose shadow
tokens show quality within δ keeps the active set, unchecked tokens and other versions stay out
of the distributions."""

from __future__ import annotations

from datetime import datetime, timedelta

import numpy as np
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.alerts.hook_service import create_hook, hooks_for
from controlplane.alerts.models import Alert
from controlplane.alerts.reports import report_html
from controlplane.calibration.models import CalibrationJob
from controlplane.db import utcnow
from controlplane.deployments.service import aliases_of, move_alias, publish
from controlplane.drift.service import DriftOptions, check_deployment, exit_behaviour_conditions
from controlplane.telemetry.service import exit_rates
from tests.support.alerts import LAYERS, make_deployment
from tests.support.clustered_traffic import Requests, send_requests


def _setup(session, minutes=30, **options):
    now = utcnow().replace(second=30, microsecond=0)
    start = (now - timedelta(minutes=minutes)).replace(second=0)
    return make_deployment(session, activated_at=start, **options), start, now


def _conditions(session, deployment, now, **options):
    conditions, _ = exit_behaviour_conditions(session=session, deployment=deployment, now=now,
                                              options=DriftOptions(**options), want_report=False)
    return conditions


@pytest.mark.slow
def test_stationary_requests_that_differ_page_nobody(session: Session, tmp_path, outbox):
    # Requests differ a lot in how early they exit; counted as tokens, the exit rates look like
    # drift (a token-level test raises an exit_rate_spike, critical, and a warning here).
    deployment, start, now = _setup(session)
    send_requests(session, deployment, start=start, phases=[Requests(30, spread=6.0)], seed=0,
                  requests_per_minute=10, tokens_per_request=50)
    result = check_deployment(session=session, deployment=deployment, options=DriftOptions(),
                              keep_reports=True, now=now)
    assert [(a.kind, a.severity) for a in result.fired] == []


@pytest.mark.slow
def test_design_effect_is_measured_on_the_windows_shadow_requests(session: Session):
    deployment, start, now = _setup(session, minutes=20, delta=0.05)
    send_requests(session, deployment, start=start, seed=1,
                  phases=[Requests(10), Requests(10, ease=0.8)])
    [spike, *_] = [c for c in _conditions(session, deployment, now) if c.kind ==
                   "exit_rate_spike"]
    measured = spike.evidence["design_effect_measured"]
    assert set(measured) <= set(LAYERS) and measured
    assert all(m["design_effect"] > 2 and m["clusters"] >= 10 for m in measured.values())
    assert spike.evidence["evidence"]["design_effect"] > 2  # the test paid for clustering


@pytest.mark.slow
def test_spike_with_shadow_quality_within_delta_keeps_the_active_set(session: Session,
                                                                      tmp_path, outbox):
    deployment, start, now = _setup(session, minutes=20, delta=0.05)
    send_requests(session, deployment, start=start, seed=1,
                  phases=[Requests(10), Requests(10, ease=0.8, mismatch_rate=0.005)])
    result = check_deployment(session=session, deployment=deployment, options=DriftOptions(),
                              keep_reports=True, now=now)
    spikes = [a for a in result.fired if a.kind == "exit_rate_spike"]
    assert spikes and not [a for a in result.fired if a.kind == "quality_regression"]
    gate = spikes[0].evidence["quality_gate"]
    assert gate["shadow_tokens"] >= 200 and gate["requests"] >= 20
    assert gate["upper_bound"] < 0.05 and gate["window"]["version"] == 2
    assert spikes[0].action_taken.startswith("rule shadow_upper_bound_within_delta")
    assert aliases_of(session=session, deployment=deployment)["active"] == 2
    job = session.scalars(select(CalibrationJob)).one()
    assert (job.trigger, job.alert_id) == ("alert", spikes[0].id)


@pytest.mark.slow
def test_spike_with_disagreement_above_delta_falls_back(session: Session, tmp_path, outbox):
    deployment, start, now = _setup(session, minutes=20, delta=0.05)
    send_requests(session, deployment, start=start, seed=1,
                  phases=[Requests(10), Requests(10, ease=0.8, mismatch_rate=0.3)])
    result = check_deployment(session=session, deployment=deployment, options=DriftOptions(),
                              keep_reports=True, now=now)
    assert {"exit_rate_spike", "quality_regression"} <= {a.kind for a in result.fired}
    assert aliases_of(session=session, deployment=deployment)["active"] == 1


@pytest.mark.slow
def test_distribution_drift_alone_informs_then_pages_when_it_persists(session: Session,
                                                                      tmp_path, outbox):
    options = DriftOptions(recent_s=300, distribution_persist_windows=2)
    deployment, start, now = _setup(session, minutes=15)
    pager = create_hook(session=session, name="pager", kind="webhook", actor="test",
                        url="http://127.0.0.1:9/hook")  # default: warning and above
    # Tokens that do not exit get less confident: the signal histogram moves, exits do not.
    end = send_requests(session, deployment, start=start, seed=2, requests_per_minute=60,
                        phases=[Requests(5), Requests(10, tail_shift=-0.25)])
    first = check_deployment(session=session, deployment=deployment, options=options,
                             keep_reports=True, now=now)
    assert [(a.dedup_key, a.severity) for a in first.fired] == [
        ("chat:distribution_drift:all", "info")]
    info = first.fired[0]
    assert info.evidence["test"] == "evidently:ks" and info.has_report
    assert b"<html" in report_html(session=session, alert=info)[:2000].lower()
    assert hooks_for(session=session, alert=info, event="firing") == []  # shown, not paged
    # The same drift, one window later: not yet two consecutive windows.
    send_requests(session, deployment, start=end, seed=3, requests_per_minute=60,
                  phases=[Requests(10, tail_shift=-0.25)])
    later = check_deployment(session=session, deployment=deployment, options=options,
                             keep_reports=True, now=now + timedelta(seconds=150))
    assert later.fired == []
    persisted = check_deployment(session=session, deployment=deployment, options=options,
                                 keep_reports=True, now=now + timedelta(seconds=300))
    assert [(a.dedup_key, a.severity) for a in persisted.fired] == [
        ("chat:distribution_drift:escalated", "warning")]
    assert persisted.fired[0].evidence["escalation"] == {
        "rule": "persisted", "windows": 2,
        "text": "persisted over 2 consecutive windows (limit 2)"}
    assert hooks_for(session=session, alert=persisted.fired[0], event="firing") == [pager]


def test_unchecked_tokens_stay_out_of_the_signal_distribution(session: Session, tmp_path,
                                                             outbox):
    # A never-exit version: only shadow tokens have a signal. Were the others stored as signal
    # 0, any change in the shadow share would move the histogram.
    never = {k: 1.0 for k in LAYERS}
    deployment, start, now = _setup(session, minutes=20)
    version = publish(session=session, deployment=deployment, thresholds=never,
                      reason="never exit", actor="test").version
    move_alias(session=session, deployment=deployment, alias="active", version=version,
               actor="test", reason="never exit")
    from controlplane.deployments.models import Alias

    session.scalars(select(Alias).where(Alias.deployment_id == deployment.id,
                                        Alias.name == "active")).one().updated_at = start
    send_requests(session, deployment, start=start, seed=4, version=version, thresholds=never,
                  phases=[Requests(10, unchecked=True, shadow_rate=0.15),
                          Requests(10, unchecked=True, shadow_rate=0.6)])
    conditions = _conditions(session, deployment, now)
    assert [c.kind for c in conditions] == []
    from controlplane.telemetry.service import signal_histogram

    histogram = signal_histogram(session=session, deployment=deployment, since=start,
                                 version=version)
    shadow_tokens = session.scalar(select(Alert.id).limit(1))  # no alert rows at all
    assert shadow_tokens is None
    # only shadow tokens (about 0.15 and 0.6 of 6,000 tokens each) are in the histogram
    assert 3800 < sum(map(sum, histogram.values())) < 5200


@pytest.mark.slow
def test_windows_of_another_version_are_never_compared(session: Session, tmp_path, outbox):
    deployment, start, now = _setup(session)
    send_requests(session, deployment, start=start, seed=5, phases=[Requests(30)])
    # Version 1 (the conservative set, a different policy) served by another runtime at the
    # same time, with very different traffic: it belongs to none of version 2's windows.
    send_requests(session, deployment, start=start, seed=6, version=1,
                  thresholds={k: 1.0 for k in LAYERS},
                  phases=[Requests(30, ease=0.2, tail_shift=-0.3, mismatch_rate=0.5)])
    result = check_deployment(session=session, deployment=deployment, options=DriftOptions(),
                              keep_reports=True, now=now)
    assert result.fired == []


def test_shadow_tokens_do_not_read_as_an_exit_rate_collapse(session: Session, tmp_path,
                                                            outbox):
    # The calibration's expected rates are the policy's. Shadow tokens run to full depth: read
    # as served tokens, a 0.3 shadow rate lowered every exit rate by 30% against them.
    scratch, start, now = _setup(session, minutes=20)
    send_requests(session, scratch, start=start, seed=7, phases=[Requests(20, ease=0.85,
                                                                          shadow_rate=0.0)])
    minutes = exit_rates(session=session, deployment=scratch, since=start, version=2)
    rates = {str(k): sum(p["exits"] for p in minutes if p["layer"] == k)
             / sum(p["tokens"] for p in minutes if p["layer"] == k) for k in LAYERS}
    assert rates["4"] > 0.15  # exits that a 30% dilution turns into a collapse
    expected = {"conditional_exit_rate": rates, "samples": {"test": 20_000}}
    deployment = make_deployment(session, name="served", activated_at=start,
                                 expected_metrics=expected)
    send_requests(session, deployment, start=start, seed=8,
                  phases=[Requests(20, ease=0.85, shadow_rate=0.3)])
    result = check_deployment(session=session, deployment=deployment, options=DriftOptions(),
                              keep_reports=True, now=now)
    assert [a.kind for a in result.fired if a.kind.startswith("exit_rate")] == []


def test_quality_shift_of_the_last_minute_pages_from_the_short_window(session: Session):
    # Nine quiet minutes and one whose exits disagree: over the ten-minute window the rate
    # stays within δ, the short windows read from the store (with the samples' times) see it.
    deployment, start, now = _setup(session, minutes=10, delta=0.05)
    send_requests(session, deployment, start=start, seed=3, requests_per_minute=60,
                  phases=[Requests(9, mismatch_rate=0.0), Requests(1, mismatch_rate=0.6)])
    whole = [c for c in _conditions(session, deployment, now, quality_windows_s=(600.0,))
             if c.kind == "quality_regression"]
    assert whole == []
    [quality] = [c for c in _conditions(session, deployment, now)
                 if c.kind == "quality_regression"]
    evidence = quality.evidence["evidence"]
    assert evidence["window"]["seconds"] in (60.0, 180.0)
    assert evidence["disagreement_rate"] > 0.05 and evidence["requests"] >= 30


def test_a_window_past_the_read_cap_is_judged_on_its_newest_shadow_tokens(session: Session):
    # A fleet ships ~10,000 shadow tokens a second: a check reads at most `max_shadow_tokens`
    # of them. Keeping the window's oldest tokens (ORDER BY ts LIMIT) would never read a shift
    # in the last minute; the read keeps the newest, and the evidence says where the capped
    # window begins.
    deployment, start, now = _setup(session, minutes=10, delta=0.05)
    send_requests(session, deployment, start=start, seed=3, requests_per_minute=60,
                  phases=[Requests(9, mismatch_rate=0.0), Requests(1, mismatch_rate=0.6)])
    capped = 1000  # of ~3,600 shadow tokens in the ten minutes, ~360 a minute
    [quality] = [c for c in _conditions(session, deployment, now, max_shadow_tokens=capped,
                                        quality_windows_s=(600.0,))
                 if c.kind == "quality_regression"]
    window = quality.evidence["evidence"]["window"]
    assert window["capped_at_tokens"] == capped
    begins = datetime.fromisoformat(window["since"]).replace(tzinfo=None)
    assert (now - timedelta(minutes=4)).replace(tzinfo=None) < begins
    assert begins < (now - timedelta(minutes=2)).replace(tzinfo=None)
    assert quality.evidence["evidence"]["disagreement_rate"] > 0.05
    # Under the cap the ten-minute window is whole, and the one quiet-looking minute in ten
    # stays within δ there (the short windows catch it: the test above).
    assert [c for c in _conditions(session, deployment, now, quality_windows_s=(600.0,))
            if c.kind == "quality_regression"] == []


def test_a_capped_shadow_read_gives_the_newest_samples_oldest_first(session: Session):
    deployment, start, _ = _setup(session, minutes=3)
    send_requests(session, deployment, start=start, seed=9, phases=[Requests(3)])
    from controlplane.telemetry.service import timed_shadow_samples_by_request

    requests, signals, _, times = timed_shadow_samples_by_request(
        session=session, deployment=deployment, since=start)
    assert len(requests) > 300 and (np.diff(times) >= 0).all()
    newest = timed_shadow_samples_by_request(session=session, deployment=deployment,
                                             since=start, limit=100)
    assert (np.diff(newest[3]) >= 0).all() and len(newest[0]) == 100
    assert newest[3][0] >= times[-100] and newest[3][-1] == times[-1]
    assert newest[1].shape == (100, signals.shape[1])
    # the same rows as the newest of the whole read (ties in time may come in either order)
    assert sorted(map(tuple, newest[1].tolist())) == sorted(map(tuple, signals[-100:].tolist()))
