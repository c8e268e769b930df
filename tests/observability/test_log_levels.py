"""Every process logs on stdout in the one shape: in JSON mode nothing but JSON objects, one a
line, each with an RFC 3339 UTC time; `EXITPLANE_LOG_LEVEL` is honoured by `exitplane worker`
and `exitplane beat` (their --loglevel only overrides it when given), and Celery's start
banners and shutdown messages do not break the JSON."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.support.processes import EXITPLANE, spawn, stop_process
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow  # worker and beat processes

RFC3339_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def _json_lines(text: str) -> list[dict]:
    lines = []
    for line in text.splitlines():
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:
            pytest.fail(f"not JSON: {line[:300]}")
    return lines


def _run(tmp_path: Path, command: list[str], until, **env: str) -> tuple[list[dict], str]:
    """Start `exitplane <command>` on the embedded default (SQLite store and broker under
    tmp_path), wait until its stdout satisfies `until`, stop it with SIGTERM; (its stdout
    lines, its stderr)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("EXITPLANE_", "OTEL_"))}
    base.update({"EXITPLANE_VAR_DIR": str(tmp_path / "var"), "EXITPLANE_LOG_FORMAT": "json",
                 "EXITPLANE_DATABASE_URL": f"sqlite:///{tmp_path / 'exitplane.db'}", **env})
    out, err = tmp_path / f"{command[0]}.out", tmp_path / f"{command[0]}.err"
    process = spawn([EXITPLANE, *command], out=out, err=err, env=base, cwd=tmp_path)
    try:
        wait_until(lambda: until(_json_lines(out.read_text())), 120,
                   f"{command[0]} to log what it is waited for")
    finally:
        stop_process(process)
    return _json_lines(out.read_text()), err.read_text()


def test_the_worker_honours_exitplane_log_level(tmp_path):
    """At debug, the worker's debug lines (its default --loglevel, info, would hide them); its
    shutdown message is JSON too."""
    subprocess.run([EXITPLANE, "db", "upgrade"], cwd=tmp_path, check=True, timeout=120,
                   capture_output=True, env={**os.environ, "EXITPLANE_DATABASE_URL":
                                             f"sqlite:///{tmp_path / 'exitplane.db'}"})
    lines, err = _run(tmp_path, ["worker"], lambda lines: any(
        line["message"].endswith(" ready.") for line in lines), EXITPLANE_LOG_LEVEL="debug")
    assert any(line["level"] == "DEBUG" for line in lines)
    assert {line["process_name"] for line in lines} == {"worker"}
    assert all(RFC3339_UTC.match(line["time"]) for line in lines), lines[0]["time"]
    assert any(line["message"] == "worker: Warm shutdown (MainProcess)" for line in lines)
    assert err.strip() == ""


def test_beat_honours_exitplane_log_level(tmp_path):
    """At debug, beat's debug lines (its default --loglevel would hide them), and no banner."""
    lines, err = _run(tmp_path, ["beat"], lambda lines: any(  # a send, logged at debug
        line["level"] == "DEBUG" and line["message"].startswith("drift.detect_all sent")
        for line in lines), EXITPLANE_LOG_LEVEL="debug", EXITPLANE_DRIFT_INTERVAL_S="1")
    assert {line["process_name"] for line in lines} == {"beat"}
    assert all(RFC3339_UTC.match(line["time"]) for line in lines)
    assert not [line for line in lines if "is starting" in line.get("message", "")]
    assert err.strip() == ""
