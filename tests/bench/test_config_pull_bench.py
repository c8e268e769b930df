"""bench/config_pull.py keeps its comparison with a baseline tree working: the options are
checked before anything starts, and a tiny run against a baseline (this tree itself) reports
the baseline's figures and `ratio_to_baseline` beside `ratio_304_to_ceiling`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.benches import load_bench

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    return load_bench("config_pull")


def test_the_options_are_checked_before_anything_starts(tmp_path, capsys):
    bench = _bench()
    args = bench.parse_args(["--baseline-tree", str(ROOT), "--rounds", "2",
                             "--database-url", "postgresql+psycopg://u@127.0.0.1:1/x",
                             "--redis-url", "redis://127.0.0.1:1/7"])
    assert args.baseline_tree == ROOT and args.rounds == 2
    assert args.database_url.startswith("postgresql") and args.redis_url.endswith("/7")
    assert bench.parse_args([]).baseline_tree is None

    for wrong, says in ((["--baseline-tree", str(tmp_path)], "not a checkout"),
                        (["--database-url", "sqlite:///x.db"], "PostgreSQL"),
                        (["--rounds", "0"], "positive")):
        with pytest.raises(SystemExit) as refused:
            bench.parse_args(wrong)
        assert refused.value.code == 2
        assert says in capsys.readouterr().err


@pytest.mark.slow  # starts two APIs and the ceiling app: ~30 s
def test_a_tiny_run_against_a_baseline_tree_reports_both_ratios():
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "config_pull.py"), "--clients", "2",
         "--seconds", "0.3", "--rounds", "1", "--baseline-tree", str(ROOT)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("command: ") and "--baseline-tree" in lines[0]
    summary = json.loads(lines[-1])
    assert summary["rps_304"] > 0 and summary["rps_304_baseline"] > 0
    assert summary["ratio_to_baseline"] > 0 and summary["ratio_304_to_ceiling"] > 0
    assert summary["baseline_tree"] == str(ROOT)
    assert summary["database"] == "sqlite" and summary["redis"] is False
