"""scripts/test_matrix.sh on a machine without one of the matrix's interpreters: `make test`
passes and names the version it skipped; with MATRIX_REQUIRED=1 (CI) the missing one fails."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MISSING = "3.99"  # no pyenv build and no python3.99 on PATH


def _run(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["scripts/test_matrix.sh", MISSING], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, **env})


def test_a_missing_interpreter_is_skipped_and_named():
    run = _run(MATRIX_REQUIRED="0")
    assert run.returncode == 0, run.stderr
    assert f"SKIPPED Python {MISSING}" in run.stderr


def test_ci_requires_every_matrix_interpreter():
    run = _run(MATRIX_REQUIRED="1")
    assert run.returncode == 2
    assert f"no Python {MISSING}" in run.stderr
