"""bench/segments.py's trial logic on records in the drift_real format whose truth is known
(synthetic: the figures that matter come from the real records; this checks the machinery):
requests stay whole, the mixes hold, and a pooled set calibrated on mostly-chat traffic breaks
δ once code dominates while the per-segment sets do not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from controlplane.stats.synthetic import shadow_samples
from tests.support.benches import load_bench

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    return load_bench("segments")


def _records(folder: Path) -> None:
    """chat: heads read it well; code: the same signal means less (over-confident heads)."""
    rng = np.random.default_rng(0)
    layers = np.array([6, 12, 18, 24])
    for name, domain, power in (("chat", "A", 1.0), ("code", "B", 0.25)):
        signals, matched = shadow_samples(120 * 32, rng=rng, domain=domain, exit_layers=layers,
                                          num_layers=30)
        order = rng.permutation(120 * 32)  # records arrive interleaved, not by request
        np.savez_compressed(folder / f"{name}-120x32.npz",
                            signals=(signals ** power).astype(np.float32)[order],
                            matched=matched[order],
                            request=np.repeat(np.arange(120), 32)[order],
                            position=np.tile(np.arange(32), 120)[order],
                            exit_layers=layers, num_layers=30, decode_s=1.0)


def test_request_groups_keep_whole_requests_in_position_order(tmp_path):
    _records(tmp_path)
    bench = _bench()
    records = {name: bench._drift_real().load_records(tmp_path / f"{name}-120x32.npz")
               for name in ("chat", "code")}
    groups = bench.request_groups(records["code"])
    assert len(groups) == 120 and all(len(g) == 32 for g in groups)
    for tokens in groups:
        assert len(set(records["code"]["request"][tokens].tolist())) == 1
        assert records["code"]["position"][tokens].tolist() == list(range(32))
    mix = bench._mix({"chat": groups[:60], "code": groups[60:]}, 0.2,
                     np.random.default_rng(1))
    assert (len(mix["chat"]), len(mix["code"])) == (15, 60)


@pytest.mark.slow  # runs the bench script's process: ~20 s
def test_the_bench_prints_its_command_and_one_json_line(tmp_path):
    _records(tmp_path)
    # 50 trials: a violation rate compared with ε = 0.1 needs more than a dozen (one trial of
    # 12 is 8%), now that the per-segment sets sit close enough to δ for the served
    # disagreement (about 2,400 served tokens, ±0.004) to cross it now and then.
    run = subprocess.run(
        [sys.executable, "-P", "bench/segments.py", "--records-dir", str(tmp_path),
         "--trials", "50"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert lines[0].startswith("command: ") and "bench/segments.py" in lines[0]
    report = json.loads(lines[-1])
    for key in ("pooled_violation_rate", "segment_violation_rate", "segment_exit_rate",
                "pooled_recalibrated_exit_rate", "epsilon", "trials"):
        assert key in report
    assert report["trials"] == 50 and report["epsilon"] == 0.1
    # the known truth of these records: the pooled set breaks δ on code-heavy traffic
    assert report["pooled_violation_rate"] > report["epsilon"]
    assert report["segment_violation_rate"] <= report["epsilon"]
    assert report["segments"]["code"]["calibration_tokens_mean"] == 15 * 32
    assert report["segments"]["chat"]["calibration_tokens_mean"] == 60 * 32


@pytest.mark.slow  # runs the bench script's process
def test_missing_records_exit_2_with_one_line(tmp_path):
    run = subprocess.run(
        [sys.executable, "-P", "bench/segments.py", "--records-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().startswith("missing ") and len(run.stderr.strip().splitlines()) == 1


def test_split_halves_keeps_each_group_in_one_half(tmp_path):
    _records(tmp_path)
    bench = _bench()
    records = bench._drift_real().load_records(tmp_path / "code-120x32.npz")
    # 120 requests on 70 files: the first 70 one per file, the next 50 a second window of
    # files 0..49 (bench/drift_real.py's code prompts past the files)
    records["group"] = np.where(records["request"] < 70, records["request"],
                                records["request"] - 70)
    requests = bench.request_groups(records)
    for seed in range(20):
        calibration, serving = bench.split_halves(records, requests, 0.5,
                                                  np.random.default_rng(seed))
        group_of = [{int(records["group"][t[0]]) for t in half}
                    for half in (calibration, serving)]
        assert not group_of[0] & group_of[1]
        assert len(group_of[0]) == len(group_of[1]) == 35
        ids = sorted(int(records["request"][t[0]]) for t in calibration + serving)
        assert ids == list(range(120))  # every request once, whole
        assert all(len(t) == 32 for t in calibration + serving)


def test_split_halves_without_groups_splits_requests_as_before(tmp_path):
    _records(tmp_path)
    bench = _bench()
    records = bench._drift_real().load_records(tmp_path / "code-120x32.npz")
    requests = bench.request_groups(records)
    calibration, serving = bench.split_halves(records, requests, 0.5,
                                              np.random.default_rng(3))
    order = np.random.default_rng(3).permutation(120)  # the split of ungrouped requests
    assert [t.tolist() for t in calibration] == [requests[i].tolist() for i in order[:60]]
    assert [t.tolist() for t in serving] == [requests[i].tolist() for i in order[60:]]


def test_run_trials_reads_groups_when_the_records_have_them(tmp_path):
    _records(tmp_path)
    bench = _bench()
    records = {name: bench._drift_real().load_records(tmp_path / f"{name}-120x32.npz")
               for name in ("chat", "code")}
    records["code"]["group"] = records["code"]["request"] // 2  # two requests per file
    report = bench.run_trials(records, trials=2, delta=0.05, epsilon=0.1)
    assert report["split_by"] == {"chat": "request", "code": "group"}
    assert report["groups_per_source"] == {"chat": 120, "code": 60}
    # the calibration half holds 30 of code's 60 groups (60 requests), 15 of them in the mix
    assert report["segments"]["code"]["calibration_tokens_mean"] == 15 * 32


def test_stack_gives_group_ids_for_the_calibrators_to_cluster_by(tmp_path):
    _records(tmp_path)
    bench = _bench()
    records = {name: bench._drift_real().load_records(tmp_path / f"{name}-120x32.npz")
               for name in ("chat", "code")}
    records["code"]["group"] = records["code"]["request"] // 2  # two requests per file
    requests = {name: bench.request_groups(records[name]) for name in ("chat", "code")}
    stacked = bench._stack(records, {"chat": requests["chat"][:3], "code": requests["code"][:4]})
    assert len(np.unique(stacked[3])) == 7  # requests
    assert len(np.unique(stacked[4])) == 3 + 2  # chat has no groups: a request each
    assert bench._ids(stacked, True, by_group=True) is stacked[4]
    assert bench._ids(stacked, True) is stacked[3] and bench._ids(stacked, False) is None


def test_first_requests_is_what_a_smaller_file_holds(tmp_path):
    _records(tmp_path)
    bench = _bench()
    records = bench._drift_real().load_records(tmp_path / "code-120x32.npz")
    records["group"] = records["request"] // 2
    first = bench.first_requests(records, 50)
    assert sorted(set(first["request"].tolist())) == list(range(50))
    assert len(first["signals"]) == len(first["matched"]) == len(first["group"]) == 50 * 32
    assert (first["group"] == first["request"] // 2).all()
    assert first["exit_layers"].tolist() == records["exit_layers"].tolist()
