"""`exitplane calibrate`: runs a recalibration in-process and prints what it published."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from click.testing import CliRunner

from controlplane.db import dispose_engines, session_scope, utcnow
from controlplane.settings import get_settings
from exitplane.cli import _moment, main
from tests.support.calibration import make_deployment, separable_samples, write_traffic


@pytest.fixture
def calibrate(db_url, tmp_path, monkeypatch):
    """Run `exitplane calibrate ARGS` against the test database."""
    monkeypatch.setenv("EXITPLANE_DATABASE_URL", db_url)
    monkeypatch.setenv("EXITPLANE_VAR_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("EXITPLANE_CALIBRATION_MIN_SAMPLES", "500")
    get_settings.cache_clear()
    yield lambda *args: CliRunner().invoke(main, ["calibrate", *args])
    get_settings.cache_clear()
    dispose_engines()


def test_calibrate_publishes_and_reports(engine, calibrate):
    signals, matched = separable_samples(3000, seed=6)
    with session_scope(engine) as session:
        make_deployment(session)
        write_traffic(session, "chat", signals, matched, start=utcnow() - timedelta(hours=1))
    done = calibrate("--deployment", "chat", "--since", "2h")
    assert done.exit_code == 0, done.output
    outcome = json.loads(done.stdout)
    assert outcome["status"] == "succeeded" and outcome["version"] == 2
    # one runtime is one witness: its first calibration waits for an operator's approval
    assert outcome["promotion"] == "awaiting_approval" and outcome["risk_bound"] <= 0.05
    assert set(outcome["thresholds"]) == {"3", "6", "9"}
    assert "calibrating" in done.stderr  # the progress bar the operator waits on


def test_calibrate_explains_bad_input_and_short_data(engine, calibrate):
    with session_scope(engine) as session:
        make_deployment(session)
    unknown = calibrate("--deployment", "nope")
    assert unknown.exit_code == 2 and "deployment 'nope' does not exist" in unknown.stderr
    garbled = calibrate("--deployment", "chat", "--since", "yesterday")
    assert garbled.exit_code == 2 and "neither an ISO time nor an age" in garbled.stderr
    short = calibrate("--deployment", "chat", "--since", "30m")
    assert short.exit_code == 0 and json.loads(short.stdout)["status"] == "waiting_for_data"
    assert "stays open" in short.stderr


def test_moments():
    assert _moment("2026-11-29T10:00:00") == datetime(2026, 11, 29, 10, tzinfo=UTC)
    assert abs((utcnow() - _moment("90m")) - timedelta(minutes=90)) < timedelta(seconds=5)
    with pytest.raises(ValueError, match="neither an ISO time"):
        _moment("5 weeks")


def test_calibrate_one_segment_and_refuse_an_unknown_one(engine, calibrate):
    from controlplane.deployments.service import publish

    signals, matched = separable_samples(3000, seed=6)
    with session_scope(engine) as session:
        deployment = make_deployment(session)
        publish(session=session, deployment=deployment, thresholds={3: 1.0, 6: 1.0, 9: 1.0},
                segments={"code": {3: 1.0, 6: 1.0, 9: 1.0}}, reason="code map", actor="test")
        write_traffic(session, "chat", signals, matched, start=utcnow() - timedelta(hours=1),
                      runtime_id="rt-code", segment="code")
    unknown = calibrate("--deployment", "chat", "--segment", "chat")
    assert unknown.exit_code == 2 and "knows no traffic segment 'chat'" in unknown.stderr
    done = calibrate("--deployment", "chat", "--since", "2h", "--segment", "code")
    assert done.exit_code == 0, done.output
    outcome = json.loads(done.stdout)
    assert outcome["status"] == "succeeded" and outcome["segment"] == "code"
