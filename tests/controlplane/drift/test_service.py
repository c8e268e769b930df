"""Drift detection on rollups written by the real ingestion: the right kind fires at the right
layer, stationary traffic stays quiet, and runtimes that go silent or lag raise runtime_stale."""

from datetime import timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.alerts.models import Alert
from controlplane.alerts.reports import report_html
from controlplane.db import utcnow
from controlplane.drift.service import (
    DriftOptions,
    check_deployment,
    check_runtimes,
    expected_reference,
)
from controlplane.runtimes.service import record_heartbeat
from exitplane.wire import Heartbeat
from tests.support.alerts import Phase, make_deployment, send_traffic

BASE_RATES = (0.25, 0.4, 0.3)


def _setup(session, minutes=30, **deployment_options):
    now = utcnow().replace(second=30, microsecond=0)
    start = (now - timedelta(minutes=minutes)).replace(second=0)
    return make_deployment(session, activated_at=start, **deployment_options), start, now


def _check(session, deployment, now, _tmp_path):
    return check_deployment(session=session, deployment=deployment, options=DriftOptions(),
                            keep_reports=True, now=now)


@pytest.mark.slow
def test_stationary_traffic_fires_nothing(session: Session, tmp_path, outbox):
    deployment, start, now = _setup(session)
    send_traffic(session, deployment, start=start, phases=[Phase(30, BASE_RATES, 0.2)], seed=1)
    result = _check(session, deployment, now, tmp_path)
    assert result.fired == [] and result.refreshed == []
    assert session.scalars(select(Alert)).all() == []


@pytest.mark.slow
def test_exit_rate_collapse_at_one_layer(session: Session, tmp_path, outbox):
    deployment, start, now = _setup(session)
    send_traffic(session, deployment, start=start, seed=2,
                 phases=[Phase(15, BASE_RATES), Phase(15, (0.25, 0.1, 0.3))])
    result = _check(session, deployment, now, tmp_path)
    exit_alerts = [a for a in result.fired if a.kind.startswith("exit_rate")]
    assert [(a.kind, a.layer, a.severity) for a in exit_alerts] == [
        ("exit_rate_collapse", 8, "warning")]
    evidence = exit_alerts[0].evidence
    assert evidence["window"]["reference"] == "first_window_after_activation"
    assert abs(evidence["evidence"]["reference"]["rate"] - 0.4) < 0.03
    assert evidence["adjusted_p_value"] <= 1e-4
    assert "fell from" in exit_alerts[0].summary
    # The signal / exit-layer distribution moved too: an info finding with its Evidently
    # report, and, corroborated by the collapse in the same window, a warning that pages.
    by_key = {a.dedup_key: a for a in result.fired if a.kind == "distribution_drift"}
    info, escalated = by_key["chat:distribution_drift:all"], \
        by_key["chat:distribution_drift:escalated"]
    assert (info.severity, escalated.severity) == ("info", "warning")
    assert escalated.evidence["escalation"]["rule"] == "corroborated"
    assert escalated.evidence["escalation"]["by"] == ["exit_rate_collapse"]
    report = report_html(session=session, alert=info).decode()
    assert info.has_report and "<html" in report[:2000].lower()
    # The next cycle refreshes, it does not duplicate.
    again = _check(session, deployment, now + timedelta(seconds=30), tmp_path)
    assert again.fired == [] and {a.id for a in again.refreshed} == {a.id for a in result.fired}


@pytest.mark.slow
def test_exit_rate_spike_against_the_calibrations_expected_rates(session: Session, tmp_path,
                                                                 outbox):
    # The shape `calibration.run` stores on the threshold sets it publishes.
    expected = {"exit_rate": {"4": 0.25, "8": 0.3, "12": 0.135},
                "conditional_exit_rate": {"4": 0.25, "8": 0.4, "12": 0.3},
                "total_exit_rate": 0.685}
    deployment, start, now = _setup(session, minutes=20, expected_metrics=expected)
    send_traffic(session, deployment, start=start, seed=3,
                 phases=[Phase(10, BASE_RATES), Phase(10, (0.25, 0.4, 0.65))])
    result = _check(session, deployment, now, tmp_path)
    spikes = [a for a in result.fired if a.kind.startswith("exit_rate")]
    assert [(a.kind, a.layer, a.severity) for a in spikes] == [("exit_rate_spike", 12,
                                                                "critical")]
    assert spikes[0].evidence["evidence"]["reference"] == {"rate": 0.3, "tokens": None}
    assert spikes[0].evidence["window"]["reference"] == "expected_metrics"


def test_expected_reference_shapes():
    layers = [4, 8]
    assert expected_reference({}, layers) is None
    shares = expected_reference({"exit_rate": {"4": 0.2, "8": 0.4}}, layers)
    assert shares[4].rate == 0.2 and abs(shares[8].rate - 0.5) < 1e-12  # 0.4 of the 0.8 left
    listed = expected_reference({"layers": [{"layer": 4, "conditional_exit_rate": 0.1},
                                            {"layer": 8, "conditional_exit_rate": 0.3}]}, layers)
    assert (listed[4].rate, listed[8].rate, listed[8].tokens) == (0.1, 0.3, None)
    assert expected_reference({"conditional_exit_rate": {"4": 0.1}}, layers) is None


def test_quality_regression_when_disagreement_exceeds_delta(session: Session, tmp_path, outbox):
    deployment, start, now = _setup(session, minutes=10, delta=0.02)
    send_traffic(session, deployment, start=start, seed=4,
                 phases=[Phase(10, BASE_RATES, shadow_rate=0.2, mismatch_rate=0.1)])
    result = _check(session, deployment, now, tmp_path)
    [quality] = [a for a in result.fired if a.kind == "quality_regression"]
    assert quality.severity == "critical" and quality.layer is None
    assert quality.evidence["test"] == "clustered_binomial_one_sided"
    assert quality.evidence["evidence"]["requests"] == 7  # the helper's request ids r0..r6
    assert quality.evidence["evidence"]["delta"] == 0.02
    assert 0.06 < quality.evidence["evidence"]["disagreement_rate"] < 0.14


def test_no_quality_alert_when_shadow_tokens_agree(session: Session, tmp_path, outbox):
    deployment, start, now = _setup(session, minutes=10, delta=0.02)
    send_traffic(session, deployment, start=start, seed=5,
                 phases=[Phase(10, BASE_RATES, shadow_rate=0.2, mismatch_rate=0.0)])
    result = _check(session, deployment, now, tmp_path)
    assert [a for a in result.fired if a.kind == "quality_regression"] == []


def test_runtime_stale_on_silence_or_old_version(session: Session, outbox):
    deployment, _, now = _setup(session, minutes=10)
    fresh = record_heartbeat(session=session, deployment=deployment,
                             beat=Heartbeat(runtime_id="rt-ok", applied_version=2))
    silent = record_heartbeat(session=session, deployment=deployment,
                              beat=Heartbeat(runtime_id="rt-silent", applied_version=2))
    lagging = record_heartbeat(session=session, deployment=deployment,
                               beat=Heartbeat(runtime_id="rt-old", applied_version=1))
    for runtime in (fresh, silent, lagging):
        runtime.last_seen = now - timedelta(seconds=10)
    silent.last_seen = now - timedelta(seconds=400)
    result = check_runtimes(session=session, deployment=deployment, stale_after_s=120,
                            clear_after_s=60, now=now)
    # One alert for the deployment, naming both runtimes (not one page per runtime).
    [alert] = result.fired
    assert alert.dedup_key == "chat:runtime_stale:all"
    assert "2 runtimes are stale" in alert.summary
    assert "rt-silent: no heartbeat for 400 s" in alert.summary
    assert "rt-old: still applies version 1; active is 2" in alert.summary
    assert [r["runtime_id"] for r in alert.evidence["runtimes"]] == ["rt-old", "rt-silent"]
    # rt-silent comes back: the open alert now names rt-old only.
    silent.last_seen = now + timedelta(seconds=60)
    lagging.last_seen = now + timedelta(seconds=60)
    result = check_runtimes(session=session, deployment=deployment, stale_after_s=120,
                            clear_after_s=60, now=now + timedelta(seconds=61))
    assert result.fired == [] and [a.id for a in result.refreshed] == [alert.id]
    assert alert.summary.startswith("1 runtime is stale: rt-old") and "rt-silent" not in \
        alert.summary
    # rt-old applies the active version: the alert clears, then resolves after the period.
    lagging.applied_version = 2
    fresh.last_seen = now + timedelta(seconds=60)
    check_runtimes(session=session, deployment=deployment, stale_after_s=120, clear_after_s=60,
                   now=now + timedelta(seconds=62))
    result = check_runtimes(session=session, deployment=deployment, stale_after_s=120,
                            clear_after_s=60, now=now + timedelta(seconds=125))
    assert [a.dedup_key for a in result.resolved] == ["chat:runtime_stale:all"]


@pytest.mark.slow
def test_a_thousand_silent_runtimes_page_once(session: Session, outbox):
    deployment, _, now = _setup(session, minutes=10)
    for index in range(1000):
        runtime = record_heartbeat(session=session, deployment=deployment,
                                   beat=Heartbeat(runtime_id=f"rt-{index:04d}", applied_version=2))
        runtime.last_seen = now - timedelta(seconds=400)
    result = check_runtimes(session=session, deployment=deployment, stale_after_s=120,
                            clear_after_s=60, now=now)
    [alert] = result.fired
    assert "1000 runtimes are stale" in alert.summary and "and 980 more" in alert.summary
    assert alert.evidence["stale_runtimes"] == 1000 and len(alert.evidence["runtimes"]) == 200
