"""The ingest worker gives CPU away to the processes runtimes wait for: at start it
lowers itself to EXITPLANE_INGEST_NICE, and never raises a priority it was started below."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from controlplane.settings import Settings

PROBE = ("import os; from exitplane.cli import _lower_priority; _lower_priority({nice}); "
         "print(os.getpriority(os.PRIO_PROCESS, 0))")


def _priority_after(nice: int, started_at: int) -> int:
    """The nice value of a fresh process started at `started_at` once it asked for `nice`."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(nice=nice)], capture_output=True, text=True,
        check=True, preexec_fn=lambda: os.nice(started_at) if started_at else None)
    return int(done.stdout.strip())


def test_the_worker_lowers_itself_to_the_setting():
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert _priority_after(base + 7, started_at=0) == base + 7


def test_a_worker_started_lower_stays_lower_and_zero_leaves_it_alone():
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert _priority_after(base + 3, started_at=9) == base + 9
    assert _priority_after(0, started_at=0) == base


def test_the_setting_defaults_to_ten_and_is_a_nice_value(monkeypatch):
    monkeypatch.delenv("EXITPLANE_INGEST_NICE", raising=False)
    assert Settings().ingest_nice == 10
    for wrong in ("20", "-1"):
        monkeypatch.setenv("EXITPLANE_INGEST_NICE", wrong)
        with pytest.raises(ValidationError, match="ingest_nice"):
            Settings()
