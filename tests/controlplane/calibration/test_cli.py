"""`exitplane calibrate`: runs a recalibration in-process and prints what it published."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta

from controlplane.db import session_scope, utcnow
from tests.controlplane.calibration.support import (
    make_deployment,
    separable_samples,
    write_traffic,
)


def _cli(db_url, tmp_path, *args):
    env = {**os.environ, "EXITPLANE_DATABASE_URL": db_url,
           "EXITPLANE_VAR_DIR": str(tmp_path / "var"), "EXITPLANE_CALIBRATION_MIN_SAMPLES": "500"}
    return subprocess.run([sys.executable, "-m", "exitplane.cli", "calibrate", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_calibrate_publishes_and_reports(db_url, engine, tmp_path):
    signals, matched = separable_samples(3000, seed=6)
    with session_scope(engine) as session:
        make_deployment(session)
        write_traffic(session, "chat", signals, matched, start=utcnow() - timedelta(hours=1))
    done = _cli(db_url, tmp_path, "--deployment", "chat", "--since", "2h")
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout)
    assert outcome["status"] == "succeeded" and outcome["version"] == 2
    assert outcome["promotion"] == "active" and outcome["risk_bound"] <= 0.05
    assert set(outcome["thresholds"]) == {"3", "6", "9"}


def test_calibrate_explains_bad_input(db_url, engine, tmp_path):
    with session_scope(engine) as session:
        make_deployment(session)
    unknown = _cli(db_url, tmp_path, "--deployment", "nope")
    assert unknown.returncode == 2 and "deployment 'nope' does not exist" in unknown.stderr
    garbled = _cli(db_url, tmp_path, "--deployment", "chat", "--since", "yesterday")
    assert garbled.returncode == 2 and "neither an ISO time nor an age" in garbled.stderr
    short = _cli(db_url, tmp_path, "--deployment", "chat", "--since", "30m")
    assert short.returncode == 0 and json.loads(short.stdout)["status"] == "waiting_for_data"
