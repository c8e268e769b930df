"""Answer consistency of threshold sets on shadow requests, and the answer target's test.

A shadow request (`telemetry.shadow_requests`) tells, for any threshold set, whether its answer
would have differed from full depth and where first (`stats.answers.first_divergence`, exact
under greedy decoding with an exact KV policy: docs/concepts/statistics.md, "The answer
guarantee"). Requests are drawn for shadowing at random and independently, so each one's loss
(answer differs: 1, else 0) is a Bernoulli draw of the set's answer risk, and the number that
differ among n is Binomial(n, risk): `binomial_p_value` tests "risk >= δ_answer" and
`binomial_upper_bound` bounds the risk (one-sided Clopper-Pearson), the same exact tests the
token target uses.

The evidence is read under the trust rules of every evidence read (`telemetry.trust`: excluded
runtimes, lineage, witnesses set aside, backdating), no witness keeps more than its share of the
requests (`stats.robust_evidence.cap_runtime_share`), and a verdict from `min_runtimes`
witnesses on holds without any one of them (`robust_p_values`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from controlplane.calibration.learn_then_test import (
    CalibrationResult,
    NotEnoughShadowData,
    binomial_p_value,
    binomial_upper_bound,
)
from controlplane.calibration.segments import AnswerTestFn, SegmentedCalibration
from controlplane.stats.robust_evidence import (
    EvidencePolicy,
    robust_p_values,
    runtime_count,
)
from controlplane.telemetry.shadow_requests import ShadowRequests

QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)
# Divergence-position histogram edges (tokens into the answer); the last bin is open.
HISTOGRAM_EDGES = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class AnswerConsistency:
    """One threshold set's answers on shadow requests: how many were identical to full depth,
    the bound on the share that differs (level 1-ε), and where the others first diverged."""

    requests: int
    differing: int
    identical_share: float | None  # None without requests
    differing_share: float | None
    differing_bound: float  # one-sided Clopper-Pearson at 1-ε (1.0 without requests)
    epsilon: float
    witnesses: int
    # first divergence positions (tokens into the answer) of the requests that differ
    divergence_quantiles: dict[str, float]
    divergence_histogram: list[dict[str, int | None]]
    mean_tokens: float | None  # of the requests

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def consistency(divergence: np.ndarray, *, epsilon: float, tokens: np.ndarray | None = None,
                witnesses: int = 0) -> AnswerConsistency:
    """The figures of one set from its requests' first divergence positions (m,)."""
    divergence = np.asarray(divergence, dtype=np.int64)
    n = len(divergence)
    positions = divergence[divergence >= 0]
    k = len(positions)
    counts = np.histogram(positions, bins=[*HISTOGRAM_EDGES, np.iinfo(np.int64).max])[0] \
        if k else np.zeros(len(HISTOGRAM_EDGES), dtype=np.int64)
    edges = [*HISTOGRAM_EDGES, None]
    return AnswerConsistency(
        requests=n, differing=k,
        identical_share=None if n == 0 else (n - k) / n,
        differing_share=None if n == 0 else k / n,
        differing_bound=float(binomial_upper_bound(k, n, epsilon)), epsilon=epsilon,
        witnesses=witnesses,
        divergence_quantiles={f"p{round(q * 100)}": float(np.quantile(positions, q))
                              for q in QUANTILES} if k else {},
        divergence_histogram=[{"from": int(edges[i]), "to": None if edges[i + 1] is None
                               else int(edges[i + 1]), "requests": int(counts[i])}
                              for i in range(len(HISTOGRAM_EDGES)) if counts[i]],
        mean_tokens=None if tokens is None or not len(tokens) else float(np.mean(tokens)))


def evaluate(evidence: ShadowRequests, thresholds: np.ndarray, *, epsilon: float,
             policy: EvidencePolicy | None = None, seed: int = 0) -> list[AnswerConsistency]:
    """Answer consistency of each set (rows of `thresholds`) on `evidence`, after the share
    cap of `policy` (None: the default policy)."""
    evidence = evidence.capped(policy or EvidencePolicy(), seed=seed)
    divergence = evidence.divergence(thresholds)
    tokens = np.diff(evidence.offsets)
    witnesses = runtime_count(evidence.witnesses)
    return [consistency(divergence[:, k], epsilon=epsilon, tokens=tokens, witnesses=witnesses)
            for k in range(divergence.shape[1])]


def answer_p_values(divergence: np.ndarray, *, delta_answer: float,
                    witnesses: np.ndarray | None = None, min_runtimes: int = 3) -> np.ndarray:
    """(K,) p-values for H0: P(answer differs) >= δ_answer, one per set, from the requests'
    first divergence positions (m, K): the exact binomial tail of the requests that differ
    among m (1.0 without requests). With `witnesses` (each request's), from `min_runtimes` of
    them on the largest over the requests and the requests without each one witness."""
    divergence = np.atleast_2d(np.asarray(divergence))
    differs = divergence >= 0

    def p_of(mask: np.ndarray | None) -> np.ndarray:
        part = differs if mask is None else differs[mask]
        if len(part) == 0:
            return np.ones(differs.shape[1])
        return binomial_p_value(part.sum(axis=0), len(part), delta_answer)

    if witnesses is None:
        return p_of(None)
    return robust_p_values(p_of, np.asarray(witnesses).astype(str), min_runtimes)


@dataclass(frozen=True)
class AnswerTest:
    """The answer target's test for a calibration path: each path step's p-value for
    "P(answer differs) >= δ_answer" on the shadow requests (`p_values`), which Learn-Then-Test
    combines with the token test's (`learn_then_test.calibrate_thresholds`, `answer_test`)."""

    evidence: ShadowRequests
    delta_answer: float
    min_runtimes: int = 3

    def p_values(self, path: np.ndarray, held_out: np.ndarray | None = None) -> np.ndarray:
        """(steps,) p-values of the path's threshold sets ((steps, L), exit-layer order).
        `held_out`: the witnesses the path was held out from (the cross-runtime holdout); each
        p-value is then also the larger of this one and the one on their requests alone, so
        the answers must hold on witnesses the path did not learn from too."""
        divergence = self.evidence.divergence(path)
        witnesses = np.asarray(self.evidence.witnesses, dtype=str)
        p_values = answer_p_values(divergence, delta_answer=self.delta_answer,
                                   witnesses=witnesses, min_runtimes=self.min_runtimes)
        if held_out is None or not len(held_out):
            return p_values
        theirs = np.isin(witnesses, np.asarray(held_out, dtype=str))
        return np.maximum(p_values, answer_p_values(divergence[theirs],
                                                    delta_answer=self.delta_answer))

    def figures(self, thresholds: np.ndarray, epsilon: float) -> AnswerConsistency:
        """The chosen set's answer figures on the test's requests."""
        divergence = self.evidence.divergence(np.atleast_2d(thresholds))[:, 0]
        return consistency(divergence, epsilon=epsilon, tokens=np.diff(self.evidence.offsets),
                           witnesses=runtime_count(self.evidence.witnesses))


class NotEnoughShadowRequests(NotEnoughShadowData):
    """Fewer complete shadow requests than an answer target's test needs."""

    def __init__(self, have: int, required: int) -> None:
        ValueError.__init__(
            self, f"not enough shadow requests for the answer target: need at least "
                  f"{required} complete ones (setting min_shadow_requests), have {have}; "
                  "raise the deployment's shadow_request_rate, widen the sample window or wait "
                  "for more shadow requests")
        self.counts, self.required = {"shadow_requests": have}, required


@dataclass(frozen=True)
class AnswerTarget:
    """A calibration's answer target: δ_answer and the shadow requests that test it, each
    witness already cut to its share (`capped`)."""

    evidence: ShadowRequests
    delta_answer: float
    min_runtimes: int = 3

    @classmethod
    def of(cls, evidence: ShadowRequests, *, delta_answer: float, policy: EvidencePolicy,
           seed: int) -> AnswerTarget:
        return cls(evidence=evidence.capped(policy, seed=seed), delta_answer=delta_answer,
                   min_runtimes=policy.robust_min_runtimes)

    def test(self, segment: str | None = None) -> AnswerTest:
        """The test on every request, or on `segment`'s."""
        evidence = self.evidence if segment is None else self.evidence.take(
            np.asarray(self.evidence.segments, dtype=object) == segment)
        return AnswerTest(evidence=evidence, delta_answer=self.delta_answer,
                          min_runtimes=self.min_runtimes)

    def segment_tests(self, names: set[str]) -> dict[str, Any]:
        """`calibrate_segments`' answer arguments: each segment's test, and the pooled set's
        on every request."""
        tests: dict[str, AnswerTestFn] = {name: self.test(name).p_values for name in names}
        return {"answer_tests": tests, "pooled_answer_test": self.test().p_values}

    def figures(self, thresholds: dict[int, float], *, epsilon: float,
                segment: str | None = None) -> dict[str, Any]:
        """A chosen set's answer figures, its p-value and the target, for a job's summary."""
        test = self.test(segment)
        row = np.array([[thresholds[layer] for layer in sorted(thresholds)]])
        return test.figures(row[0], epsilon).to_dict() | {
            "delta_answer": self.delta_answer, "p_value": float(test.p_values(row)[0])}

    def recorded(self, result: CalibrationResult) -> CalibrationResult:
        """`result` with its chosen set's answer figures."""
        return replace(result, answers=self.figures(result.thresholds, epsilon=result.epsilon))

    def recorded_segments(self, outcome: SegmentedCalibration) -> SegmentedCalibration:
        """`outcome` with each segment's set's answer figures on that segment's requests."""
        return replace(outcome, answers={
            name: self.figures(seg.thresholds, epsilon=seg.epsilon, segment=name)
            for name, seg in outcome.segments.items()})
