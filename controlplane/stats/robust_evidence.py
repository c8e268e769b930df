"""Robust evidence: no witness's word counts for more than its share (plain functions).

A witness (the credential that posted shadow tokens) that lies, has a bug in its match check or
serves other heads must not steer the fleet. Three bounds apply to every verdict: the share cap
(`cap_runtime_share`), leave one witness out (`robust_p_values`) and the cross-witness holdout
(`holdout_runtimes`); every random choice follows the caller's secret `seed`.
docs/concepts/witnesses.md says what each bound guarantees and why.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class EvidencePolicy:
    """How much of a verdict one witness may hold, and from how many witnesses on no single one
    may decide it."""

    max_runtime_share: float = 0.5
    robust_min_runtimes: int = 3
    max_share_of_median: float = 2.0

    @classmethod
    def from_settings(cls, settings) -> EvidencePolicy:
        return cls(max_runtime_share=settings.evidence_max_runtime_share,
                   robust_min_runtimes=settings.evidence_robust_min_runtimes,
                   max_share_of_median=settings.evidence_max_share_of_median)


def runtime_count(runtimes: Sequence | np.ndarray | None) -> int:
    """Distinct runtimes among the samples (0 when unknown)."""
    return 0 if runtimes is None or len(runtimes) == 0 else len(np.unique(np.asarray(runtimes)))


def share_limit(tokens: np.ndarray, max_share: float) -> float:
    """The most tokens any one runtime may keep: the largest M with M <= share x sum_i
    min(n_i, M) (water-filling; the share is raised to 1/k when k runtimes cannot all stay
    under it). Infinity when no runtime is over it."""
    tokens = np.sort(np.asarray(tokens, dtype=float))
    if len(tokens) < 2:
        return float("inf")
    share = max(max_share, 1.0 / len(tokens))
    if tokens[-1] <= share * tokens.sum():
        return float("inf")
    # sum_i min(n_i, M) - M / share is concave in M and 0 at M = 0: bisect its last root.
    low, high = 0.0, float(tokens[-1])
    for _ in range(60):
        mid = 0.5 * (low + high)
        if mid <= share * np.minimum(tokens, mid).sum() + 1e-9:
            low = mid
        else:
            high = mid
    return low


def cap_runtime_share(runtimes: np.ndarray, requests: np.ndarray, *, max_share: float,
                      seed: int = 0, min_runtimes: int = 3,
                      max_share_of_median: float | None = 2.0) -> np.ndarray:
    """Boolean mask of the samples kept so that no witness holds more than
    `max_share_of_median` times the median witness's samples, nor more than `max_share` of
    them (docs/concepts/witnesses.md; None: the share alone): a witness over the limit keeps whole
    requests, drawn at random by `seed`, up to it (at least one). With fewer than
    `min_runtimes` witnesses every sample is kept."""
    runtimes, requests = np.asarray(runtimes).astype(str), np.asarray(requests).astype(str)
    keep = np.ones(len(runtimes), dtype=bool)
    names, codes, counts = np.unique(runtimes, return_inverse=True, return_counts=True)
    if len(names) < max(2, min_runtimes):
        return keep
    limit = share_limit(counts, max_share)
    if max_share_of_median is not None:
        # any M below the share's limit meets the share as well (share_limit is concave)
        limit = min(limit, max_share_of_median * float(np.median(counts)))
    if not np.isfinite(limit) or counts.max() <= limit:
        return keep
    rng = np.random.default_rng(seed)
    for index in range(len(names)):
        if counts[index] <= limit:
            continue
        mine = np.flatnonzero(codes == index)
        ids, inverse, sizes = np.unique(requests[mine], return_inverse=True, return_counts=True)
        order = rng.permutation(len(ids))
        room = np.cumsum(sizes[order]) <= max(limit, sizes[order[0]])
        chosen = np.zeros(len(ids), dtype=bool)
        chosen[order[room]] = True
        keep[mine] = chosen[inverse]
    return keep


def leave_one_out(runtimes: np.ndarray | None, min_runtimes: int) -> list[np.ndarray]:
    """Masks of the samples without each runtime's, one per runtime; none when fewer than
    `min_runtimes` runtimes report (docs/concepts/witnesses.md)."""
    if runtimes is None or len(runtimes) == 0:
        return []
    names, codes = np.unique(np.asarray(runtimes).astype(str), return_inverse=True)
    if len(names) < max(2, min_runtimes):
        return []
    return [codes != index for index in range(len(names))]


def robust_p_values(p_values_of: Callable[[np.ndarray | None], np.ndarray],
                    runtimes: np.ndarray | None, min_runtimes: int) -> np.ndarray:
    """The largest of `p_values_of(mask)` over the whole sample (mask None) and each sample
    without one runtime's (`leave_one_out`), element-wise: a verdict no single runtime can
    decide."""
    worst = np.asarray(p_values_of(None), dtype=float)
    for mask in leave_one_out(runtimes, min_runtimes):
        worst = np.maximum(worst, np.asarray(p_values_of(mask), dtype=float))
    return worst


def held_out_count(tokens: np.ndarray, *, fraction: float, min_test_runtimes: int) -> int:
    """How many witnesses to hold out, given their token counts in holdout order: as many as
    it takes to hold `fraction` of the tokens or `fraction` of the witnesses, whichever is
    more; then at least two and at most all but `min_test_runtimes` when the fleet has room
    for both; one when only the test's `min_test_runtimes` fit beside it (leave-one-out in
    the test is what beats two colluders of four); else at least one and never all."""
    k = len(tokens)
    by_tokens = 1 + int(np.searchsorted(np.cumsum(tokens) / np.sum(tokens), fraction - 1e-12))
    count = max(by_tokens, math.ceil(fraction * k - 1e-12))
    if k >= min_test_runtimes + 2:
        return int(min(max(count, 2), k - min_test_runtimes))
    if k == min_test_runtimes + 1:
        return 1
    return int(min(count, k - 1))


def holdout_runtimes(runtimes: np.ndarray, *, fraction: float, seed: int,
                     min_test_runtimes: int = 3) -> np.ndarray | None:
    """Boolean mask of the samples of the witnesses held out for the cross-witness check: whole
    witnesses in a random order drawn by `seed`, as many as `held_out_count` says (so that
    leave-one-out can run on the `min_test_runtimes` left in the test, and neither a heavy
    witness nor one with a handful of tokens is the whole holdout); None with fewer than two
    witnesses."""
    names, codes, counts = np.unique(np.asarray(runtimes).astype(str), return_inverse=True,
                                     return_counts=True)
    if len(names) < 2:
        return None
    order = np.random.default_rng(seed).permutation(len(names))
    count = held_out_count(counts[order], fraction=fraction,
                           min_test_runtimes=min_test_runtimes)
    return np.isin(codes, order[:count])
