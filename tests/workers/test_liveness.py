"""Heartbeats for liveness probes: what a promise means to the probe, and the worker, beat and
ingest processes renewing theirs from their own loops (a loop that stops stops renewing)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from exitplane.kit.liveness import main, problem, promise
from tests.support.processes import ROOT, stop_process
from tests.support.waiting import wait_until

EXITPLANE = str(Path(sys.executable).parent / "exitplane")


def _probe(path: Path) -> subprocess.CompletedProcess:
    """The liveness probe as the manifests run it."""
    return subprocess.run([sys.executable, "-m", "exitplane.kit.liveness", str(path)],
                          capture_output=True, text=True, timeout=30)


def _deadline(path: Path) -> float:
    return float(path.read_text())


def test_a_promise_holds_until_its_time(tmp_path):
    heartbeat = tmp_path / "heartbeat"
    assert "no heartbeat yet" in problem(heartbeat)
    assert _probe(heartbeat).returncode == 1
    promise(heartbeat, 30)
    assert problem(heartbeat) is None and main([str(heartbeat)]) == 0
    assert _probe(heartbeat).returncode == 0
    assert "promised to be back 1 s ago" in problem(heartbeat, now=_deadline(heartbeat) + 1)
    promise(heartbeat, -5)  # a promise that has passed
    failed = _probe(heartbeat)
    assert failed.returncode == 1 and "promised to be back" in failed.stderr
    heartbeat.write_text("alive\n")
    assert "not a heartbeat" in problem(heartbeat)
    assert main([]) == 2
    assert list(tmp_path.iterdir()) == [heartbeat]  # written whole, nothing left beside it


def _env(tmp_path: Path, postgres_url: str, heartbeat: Path) -> dict[str, str]:
    redis_url = os.environ.get("EXITPLANE_TEST_REDIS_URL")
    if not redis_url:
        raise RuntimeError("this test needs Redis: run `make test`, or set "
                           "EXITPLANE_TEST_REDIS_URL (scripts/services.sh start writes it)")
    # a database number of its own: this test's ingest worker reads no other test's streams
    redis_url = re.sub(r"/\d*$", "", redis_url) + "/13"
    return {**os.environ, "EXITPLANE_DATABASE_URL": postgres_url,
            "EXITPLANE_REDIS_URL": redis_url, "EXITPLANE_VAR_DIR": str(tmp_path / "var"),
            "EXITPLANE_HEARTBEAT_FILE": str(heartbeat), "EXITPLANE_WORKER_METRICS_PORT": "0",
            "EXITPLANE_INGEST_NICE": "0"}


def _start(tmp_path: Path, env: dict[str, str], *command: str) -> subprocess.Popen:
    log = (tmp_path / f"{command[0]}.log").open("a")
    return subprocess.Popen([EXITPLANE, *command], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)


def _stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGCONT)
    stop_process(process)


@pytest.mark.slow
@pytest.mark.postgres
def test_the_ingest_loop_renews_its_promise_and_a_hung_loop_does_not(tmp_path,
                                                                      postgres_migrated):
    heartbeat = tmp_path / "heartbeat"
    ingest = _start(tmp_path, _env(tmp_path, postgres_migrated, heartbeat), "ingest")
    try:
        wait_until(heartbeat.exists, 60, "the ingest worker's first heartbeat")
        first = _deadline(heartbeat)
        assert time.time() < first <= time.time() + 120
        wait_until(lambda: _deadline(heartbeat) > first, 10, "a renewal (one per cycle)")
        assert _probe(heartbeat).returncode == 0
        ingest.send_signal(signal.SIGSTOP)  # the loop stands still, as a hung one would
        time.sleep(0.5)
        held = _deadline(heartbeat)
        time.sleep(3.0)  # three cycles' time
        assert _deadline(heartbeat) == held
        ingest.send_signal(signal.SIGCONT)
        wait_until(lambda: _deadline(heartbeat) > held, 10, "renewals after it resumes")
    finally:
        _stop(ingest)


@pytest.mark.slow
@pytest.mark.postgres
def test_worker_and_beat_promise_from_their_loops(tmp_path, postgres_migrated):
    worker_heartbeat, beat_heartbeat = tmp_path / "worker.heartbeat", tmp_path / "beat.heartbeat"
    env = _env(tmp_path, postgres_migrated, worker_heartbeat)
    worker = _start(tmp_path, env, "worker")
    beat = _start(tmp_path, {**env, "EXITPLANE_HEARTBEAT_FILE": str(beat_heartbeat)}, "beat")
    try:
        wait_until(beat_heartbeat.exists, 60, "beat's first heartbeat")
        assert _probe(beat_heartbeat).returncode == 0
        # every scheduler tick renews it: at least every 30 s whatever the schedule
        assert _deadline(beat_heartbeat) <= time.time() + 180
        wait_until(worker_heartbeat.exists, 90, "the worker's first heartbeat")
        assert _probe(worker_heartbeat).returncode == 0
        # the consumer's timer renews it every 10 s once the worker consumes (the promise at
        # start covers start-up; an idle one promises a minute)
        wait_until(lambda: _deadline(worker_heartbeat) <= time.time() + 61, 120,
                   "the worker to promise as an idle consumer")
        renewed = _deadline(worker_heartbeat)
        wait_until(lambda: _deadline(worker_heartbeat) > renewed, 25, "a renewal")
        worker.send_signal(signal.SIGSTOP)
        time.sleep(0.5)
        held = _deadline(worker_heartbeat)
        time.sleep(12.0)  # longer than a renewal period
        assert _deadline(worker_heartbeat) == held
    finally:
        _stop(worker)
        _stop(beat)
        redis.Redis.from_url(env["EXITPLANE_REDIS_URL"]).flushdb()  # the tasks beat queued
