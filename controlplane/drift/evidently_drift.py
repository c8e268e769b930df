"""Signal- and exit-layer-distribution drift with Evidently 0.7 (`Report` + `ValueDrift`).

Evidently picks the drift method per column from the data (KS / chi-square on small samples,
normed Wasserstein / Jensen-Shannon distance above 1,000 rows) unless `methods` names one; its
verdict is the drift flag. Because distance methods give no p-value, every column also gets a
scipy p-value (two-sample KS for numerical, chi-square on the contingency table for
categorical) as supporting evidence. The rendered HTML report is returned as a string for the
service to store and link from the alert.

`two_sample_thresholds` makes those scipy p-values the verdict instead: Evidently's own
categorical chi-square is a goodness-of-fit test that takes the reference proportions as known,
so a short reference with rare categories (exits at a deep layer) looks like drift; the
contingency-table test counts the reference as the sample it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from evidently import DataDefinition, Dataset, Report
from evidently.core.metric_types import MetricTestResult
from evidently.metrics import ValueDrift
from scipy.stats import chi2_contingency, ks_2samp

from controlplane.drift.detectors import DISTRIBUTION_DRIFT, SEVERITY, DriftFinding

DEFAULT_NUMERICAL = ("signal",)
DEFAULT_CATEGORICAL = ("exit_layer",)


@dataclass(frozen=True)
class ColumnDrift:
    """Evidently's verdict on one column plus a scipy p-value."""

    column: str
    method: str
    statistic: float
    threshold: float
    drift_detected: bool
    p_value: float
    p_value_test: str

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class DistributionDriftReport:
    """Per-column drift results and the Evidently HTML report."""

    drift_detected: bool
    columns: list[ColumnDrift]
    reference_rows: int
    current_rows: int
    html: str | None

    def evidence(self) -> dict[str, Any]:
        """JSON-serialisable summary (everything but the HTML)."""
        return {
            "drift_detected": self.drift_detected,
            "reference_rows": self.reference_rows,
            "current_rows": self.current_rows,
            "columns": [c.to_dict() for c in self.columns],
        }

    def to_finding(self, *, layer: int | None = None) -> DriftFinding | None:
        """A `distribution_drift` finding when any column drifted, else None."""
        drifted = [c for c in self.columns if c.drift_detected]
        if not drifted:
            return None
        worst = min(drifted, key=lambda c: c.p_value)
        return DriftFinding(
            DISTRIBUTION_DRIFT,
            layer,
            SEVERITY[DISTRIBUTION_DRIFT],
            f"evidently:{worst.method}",
            worst.statistic,
            worst.p_value,
            worst.p_value,
            self.evidence(),
        )


def histogram_samples(
    edges: Sequence[float], counts: Sequence[int], *, max_rows: int = 20_000
) -> np.ndarray:
    """Bin midpoints repeated by count: samples for Evidently from a rollup's signal histogram.

    Counts are scaled down proportionally when they sum to more than `max_rows`.
    """
    edges_arr, counts_arr = np.asarray(edges, dtype=float), np.asarray(counts, dtype=float)
    if len(edges_arr) != len(counts_arr) + 1:
        raise ValueError(
            f"need len(edges) == len(counts) + 1, got {len(edges_arr)}, {len(counts_arr)}"
        )
    total = counts_arr.sum()
    if total > max_rows:
        counts_arr = counts_arr * (max_rows / total)
    midpoints = 0.5 * (edges_arr[:-1] + edges_arr[1:])
    return np.repeat(midpoints, np.round(counts_arr).astype(int))


def _frame(data: pd.DataFrame | Mapping[str, Sequence[Any]], columns: Sequence[str]):
    frame = data if isinstance(data, pd.DataFrame) else pd.DataFrame(dict(data))
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(f"columns {missing} missing from the samples; got {list(frame.columns)}")
    return frame[list(columns)].dropna().reset_index(drop=True)


def _scipy_p_value(ref: pd.Series, cur: pd.Series, categorical: bool) -> tuple[float, str]:
    if not categorical:
        return float(ks_2samp(ref.to_numpy(), cur.to_numpy()).pvalue), "ks_2samp"
    categories = sorted(set(ref.unique()) | set(cur.unique()))
    table = np.array(
        [[(ref == c).sum() for c in categories], [(cur == c).sum() for c in categories]]
    )
    if len(categories) < 2:
        return 1.0, "chi2_contingency"
    return float(chi2_contingency(table).pvalue), "chi2_contingency"


def _drift_status(tests: Sequence[MetricTestResult]) -> bool:
    return any(t.status.value == "FAIL" for t in tests)


def distribution_drift_report(
    *,
    reference: pd.DataFrame | Mapping[str, Sequence[Any]],
    current: pd.DataFrame | Mapping[str, Sequence[Any]],
    numerical_columns: Sequence[str] = DEFAULT_NUMERICAL,
    categorical_columns: Sequence[str] = DEFAULT_CATEGORICAL,
    methods: Mapping[str, str] | None = None,
    thresholds: Mapping[str, float] | None = None,
    include_html: bool = True,
    two_sample_thresholds: Mapping[str, float] | None = None,
) -> DistributionDriftReport:
    """Compare current vs reference samples column by column with Evidently `ValueDrift`.

    Typical columns: `signal` (signal value at exit, numerical) and `exit_layer` (categorical).
    `methods`/`thresholds` override Evidently's per-column choice (e.g. {"signal": "psi"}).
    Raises ValueError when a column is missing or either side has no rows.
    """
    columns = [*numerical_columns, *categorical_columns]
    ref, cur = _frame(reference, columns), _frame(current, columns)
    if ref.empty or cur.empty:
        raise ValueError(
            f"need samples on both sides; got {len(ref)} reference and {len(cur)} current rows"
        )
    for col in categorical_columns:  # stable category labels for Evidently and the HTML
        ref[col], cur[col] = ref[col].astype(str), cur[col].astype(str)
    definition = DataDefinition(
        numerical_columns=list(numerical_columns), categorical_columns=list(categorical_columns)
    )
    methods, thresholds = methods or {}, thresholds or {}
    if two_sample_thresholds and set(columns) <= set(two_sample_thresholds):
        # The verdict is the scipy tests': when none of them flags, Evidently (most of a
        # check's time) has nothing to add, so its report is only built for a finding.
        quick = []
        for col in columns:
            p_value, p_test = _scipy_p_value(ref[col], cur[col], col in categorical_columns)
            quick.append(ColumnDrift(column=col, method=p_test, statistic=p_value,
                                     threshold=two_sample_thresholds[col],
                                     drift_detected=p_value < two_sample_thresholds[col],
                                     p_value=p_value, p_value_test=p_test))
        if not any(c.drift_detected for c in quick):
            return DistributionDriftReport(drift_detected=False, columns=quick,
                                           reference_rows=len(ref), current_rows=len(cur),
                                           html=None)
    metrics = [
        ValueDrift(column=c, method=methods.get(c), threshold=thresholds.get(c)) for c in columns
    ]
    snapshot = Report(metrics, include_tests=True).run(
        Dataset.from_pandas(cur, data_definition=definition),
        Dataset.from_pandas(ref, data_definition=definition),
    )
    by_column = {
        r.metric_value_location.metric.params["column"]: r for r in snapshot.metric_results.values()
    }
    column_drifts = []
    for col in columns:
        result = by_column[col]
        params = result.metric_value_location.metric.params
        p_value, p_test = _scipy_p_value(ref[col], cur[col], col in categorical_columns)
        drifted = _drift_status(result.tests)
        if two_sample_thresholds and col in two_sample_thresholds:
            drifted = p_value < two_sample_thresholds[col]
        column_drifts.append(
            ColumnDrift(
                column=col,
                method=str(params.get("method")),
                statistic=float(result.value),
                threshold=float(params.get("threshold")),
                drift_detected=drifted,
                p_value=p_value,
                p_value_test=p_test,
            )
        )
    return DistributionDriftReport(
        drift_detected=any(c.drift_detected for c in column_drifts),
        columns=column_drifts,
        reference_rows=len(ref),
        current_rows=len(cur),
        html=snapshot.get_html_str(as_iframe=False) if include_html else None,
    )
