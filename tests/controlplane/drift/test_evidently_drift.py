"""Evidently 0.7 distribution-drift helper on seeded samples."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from controlplane.drift.detectors import DISTRIBUTION_DRIFT
from controlplane.drift.evidently_drift import distribution_drift_report, histogram_samples

LAYERS = [8, 16, 24, 30]


def _samples(seed: int, n: int, *, shift: float = 0.0, layer_p=(0.25, 0.25, 0.25, 0.25)):
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "signal": np.clip(rng.beta(5, 2, n) - shift, 0.0, 1.0),
            "exit_layer": rng.choice(LAYERS, n, p=layer_p),
        }
    )


def test_same_distribution_no_drift():
    report = distribution_drift_report(reference=_samples(0, 3000), current=_samples(1, 3000))
    assert not report.drift_detected
    assert [c.column for c in report.columns] == ["signal", "exit_layer"]
    assert all(not c.drift_detected and c.p_value > 0.001 for c in report.columns)
    assert report.to_finding() is None
    assert report.html is not None and "<html" in report.html.lower()


def test_shifted_signal_and_exit_layers_drift():
    current = _samples(2, 3000, shift=0.15, layer_p=(0.1, 0.1, 0.3, 0.5))
    report = distribution_drift_report(reference=_samples(0, 3000), current=current)
    assert report.drift_detected
    by_column = {c.column: c for c in report.columns}
    assert by_column["signal"].drift_detected and by_column["exit_layer"].drift_detected
    assert by_column["signal"].statistic > by_column["signal"].threshold  # a distance here
    assert by_column["exit_layer"].p_value < 1e-6
    finding = report.to_finding(layer=None)
    assert finding is not None and finding.kind == DISTRIBUTION_DRIFT
    evidence = json.loads(json.dumps(finding.to_dict()))["evidence"]
    assert evidence["current_rows"] == 3000 and len(evidence["columns"]) == 2


def test_only_exit_layers_shift_small_samples_use_p_value_method():
    # Below 1,000 rows Evidently uses chi-square (a p-value) for categorical columns.
    reference = _samples(3, 800)
    current = _samples(4, 800, layer_p=(0.4, 0.3, 0.2, 0.1))
    report = distribution_drift_report(
        reference=reference, current=current, numerical_columns=(), include_html=False
    )
    (column,) = report.columns
    assert column.drift_detected and "chi-square" in column.method
    assert column.statistic < column.threshold and report.html is None


def test_method_override_and_missing_column():
    report = distribution_drift_report(
        reference=_samples(0, 2000),
        current=_samples(1, 2000),
        methods={"signal": "psi"},
        include_html=False,
    )
    assert report.columns[0].method.lower().startswith("psi")
    assert not report.columns[0].drift_detected
    with pytest.raises(ValueError, match="missing"):
        distribution_drift_report(reference={"signal": [0.1]}, current={"signal": [0.2]})


def test_histogram_rollups_feed_the_report():
    edges = np.linspace(0.0, 1.0, 11)
    reference = histogram_samples(edges, [0, 0, 10, 40, 100, 200, 300, 200, 100, 50])
    assert len(reference) == 1000 and reference.min() == pytest.approx(0.25)
    shifted = histogram_samples(edges, [0, 0, 0, 0, 10, 40, 100, 300, 400, 150])
    scaled = histogram_samples(edges, [0, 0, 0, 0, 1000, 4000, 10000, 30000, 40000, 15000],
                               max_rows=1000)  # fmt: skip
    assert len(scaled) == 1000
    report = distribution_drift_report(
        reference={"signal": reference},
        current={"signal": shifted},
        categorical_columns=(),
        include_html=False,
    )
    assert report.drift_detected
    with pytest.raises(ValueError, match="len\\(edges\\)"):
        histogram_samples([0.0, 1.0], [1, 2])


def test_two_sample_verdict_counts_the_reference_as_a_sample():
    # Rare deep exits in a short reference: Evidently's chi-square takes the reference's
    # proportions as known and flags; the contingency-table test does not.
    rare = (0.004, 0.006, 0.01, 0.98)
    reference, current = _samples(3, 700, layer_p=rare), _samples(4, 2500, layer_p=rare)
    tests = {"signal": 1e-3, "exit_layer": 1e-3}
    plain = distribution_drift_report(reference=reference, current=current,
                                      methods={"signal": "ks", "exit_layer": "chisquare"},
                                      thresholds=tests, include_html=False)
    two_sample = distribution_drift_report(reference=reference, current=current,
                                           methods={"signal": "ks", "exit_layer": "chisquare"},
                                           thresholds=tests, include_html=False,
                                           two_sample_thresholds=tests)
    assert not two_sample.drift_detected and two_sample.html is None
    by_column = {c.column: c for c in two_sample.columns}
    assert by_column["exit_layer"].p_value_test == "chi2_contingency"
    assert by_column["exit_layer"].p_value > 1e-3
    shifted = distribution_drift_report(
        reference=reference, current=_samples(5, 2500, shift=0.2, layer_p=rare),
        two_sample_thresholds=tests, methods={"signal": "ks", "exit_layer": "chisquare"},
        thresholds=tests)
    assert shifted.drift_detected and shifted.html is not None  # the report for a finding
    assert plain.drift_detected  # what the goodness-of-fit verdict said on the same data
