"""Robust evidence: no runtime's word counts for more than its share (plain functions).

A runtime is a witness, not a judge. Its shadow tokens are evidence about the thresholds, but a
runtime that lies, has a bug in its match check or serves other heads would otherwise steer the
whole fleet: one runtime's forged all-matched tokens certified thresholds 0.0 everywhere. Three
bounds, borrowed from robust aggregation in federated learning (each client's update clipped,
the verdict made to survive any single client):

- **Share cap** (`cap_runtime_share`): in a fleet of at least `robust_min_runtimes` runtimes,
  a runtime holding more than `max_runtime_share` of a verdict's shadow tokens is subsampled,
  whole requests at random, down to that share (a flooding runtime cannot drown the others).
  Below that there is no majority for the cap to protect: capping the larger of two runtimes
  to the smaller's size would only throw honest evidence away, and the cross-runtime holdout
  (below) already keeps either one from certifying a set alone. Within a runtime, a request's
  share is bounded by the request-level statistics (`controlplane.stats.clustered`: a request
  counts as the evidence its clustering is worth, not as its token count).
- **Leave one runtime out** (`robust_p_values`): in a fleet of at least `robust_min_runtimes`
  runtimes a verdict's p-value is the largest over the whole sample and each sample without
  one runtime's tokens. The largest of valid p-values is valid, so the level holds; and since
  the verdict must hold without any one runtime, no single runtime can decide it: not a
  calibration step (its forged agreement certifies nothing the others do not), not a quality
  regression (its forged disagreement does not fire the fallback), not an exit-rate spike or
  collapse (its rollups are left out in turn, `drift.window_checks.robust_exit_findings`), not
  a canary's verdict.
- **Cross-runtime holdout** (`holdout_runtimes`): whole runtimes are held out of the path and
  its test, and every step of the path must be certified on their shadow tokens as well as on
  the test's (each step's p-value is the larger of the two: valid, and since both samples must
  show the risk within δ, a set is certified only where runtimes it did not learn from agree).
  So a set learned on a lying runtime meets honest traffic first, no single runtime certifies
  a set even in a fleet of two, and the finite-sample error of one sample is checked by
  another independent one (the chosen set's risk exceeds δ far less often than ε allows).

With one runtime there is no fleet to check it against: the bounds on how far an automatic
promotion may move (`controlplane.calibration.promotion`) do the work then.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class EvidencePolicy:
    """How much of a verdict one runtime may hold, and from how many runtimes on no single one
    may decide it."""

    max_runtime_share: float = 0.5
    robust_min_runtimes: int = 3

    @classmethod
    def from_settings(cls, settings) -> EvidencePolicy:
        return cls(max_runtime_share=settings.evidence_max_runtime_share,
                   robust_min_runtimes=settings.evidence_robust_min_runtimes)


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
                      seed: int = 0, min_runtimes: int = 3) -> np.ndarray:
    """Boolean mask of the samples kept so that no runtime holds more than `max_share` of them
    (module docstring): a runtime over the limit keeps whole requests, drawn at random, up to
    it (at least one). With fewer than `min_runtimes` runtimes every sample is kept (module
    docstring: with two there is no majority to protect, and the cross-runtime holdout already
    keeps either from certifying alone)."""
    runtimes, requests = np.asarray(runtimes).astype(str), np.asarray(requests).astype(str)
    keep = np.ones(len(runtimes), dtype=bool)
    names, codes, counts = np.unique(runtimes, return_inverse=True, return_counts=True)
    if len(names) < max(2, min_runtimes):
        return keep
    limit = share_limit(counts, max_share)
    if not np.isfinite(limit):
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
    `min_runtimes` runtimes report (module docstring)."""
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


def holdout_runtimes(runtimes: np.ndarray, *, fraction: float, seed: int) -> np.ndarray | None:
    """Boolean mask of the samples of the runtimes held out for the cross-runtime check: whole
    runtimes in random order until they hold `fraction` of the samples (at least one runtime,
    never all), so that a runtime with a handful of tokens is not the whole holdout the
    candidate must be certified on; None with fewer than two."""
    names, codes, counts = np.unique(np.asarray(runtimes).astype(str), return_inverse=True,
                                     return_counts=True)
    if len(names) < 2:
        return None
    order = np.random.default_rng(seed).permutation(len(names))
    held = np.cumsum(counts[order]) / counts.sum()
    count = min(len(names) - 1, 1 + int(np.searchsorted(held, fraction - 1e-12)))
    return np.isin(codes, order[:count])
