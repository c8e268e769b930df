"""What a token costs, fitted from what runtimes report: wall time as a fixed overhead, a time
per decoder layer run and a time per exit check computed,

    time(token) = overhead_us + layer_us * depth + check_us * checks,

fitted by non-negative least squares on groups of tokens (one group per rollup cell: tokens
that left at one layer, with their summed wall time and checks). A token at full depth with no
checks costs `full_depth_us`: the baseline early exit is measured against. Plain numpy; the
control plane's savings, the what-if and the runtime's benchmark use the same fit."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

# Fewer timed tokens than this, or fewer than two distinct depths, leave the per-layer time
# unidentified: no model is fitted.
MIN_TIMED_TOKENS = 50


@dataclass(frozen=True, slots=True)
class CostModel:
    """Microseconds per token: `overhead_us + layer_us * depth + check_us * checks`."""

    overhead_us: float
    layer_us: float
    check_us: float
    num_layers: int
    tokens: int  # timed tokens the fit used

    def token_us(self, depth: float, checks: float) -> float:
        return self.overhead_us + self.layer_us * depth + self.check_us * checks

    @property
    def full_depth_us(self) -> float:
        """One token at full depth with no exit checks: what a model without early exit pays."""
        return self.overhead_us + self.layer_us * self.num_layers

    def as_dict(self) -> dict:
        return {**asdict(self), "full_depth_us": self.full_depth_us}


def fit_cost_model(depths, checks, latency_us, tokens, *, num_layers: int) -> CostModel | None:
    """The cost model of groups of tokens: group i is `tokens[i]` tokens that each ran
    `depths[i]` layers, computing `checks[i]` exit checks in all (summed over the group) and
    taking `latency_us[i]` microseconds in all. None when the groups cannot identify a time
    per layer (fewer than MIN_TIMED_TOKENS tokens, or one depth only) or checks that vary with
    nothing but depth leave the time per check unidentified.

    Weighted least squares on the groups' means (weights: tokens), coefficients held
    non-negative (a coefficient the data would make negative is dropped and the rest refitted:
    a negative time per check is noise, not a refund)."""
    depths = np.asarray(depths, dtype=float)
    checks = np.asarray(checks, dtype=float)
    latency = np.asarray(latency_us, dtype=float)
    counts = np.asarray(tokens, dtype=float)
    keep = counts > 0
    depths, checks, latency, counts = depths[keep], checks[keep], latency[keep], counts[keep]
    total = int(counts.sum())
    if total < MIN_TIMED_TOKENS or len(np.unique(depths)) < 2:
        return None
    design = np.column_stack([np.ones_like(depths), depths, checks / counts])
    # No checks at all: nothing to time them by (check_us stays 0). Checks that only move with
    # depth (or not at all): a time per check cannot be told from overhead and layers.
    active = [0, 1, 2] if checks.any() else [0, 1]
    if np.linalg.matrix_rank(design[:, active]) < len(active):
        return None
    target = latency / counts
    weights = np.sqrt(counts)
    coefficients = np.zeros(3)
    while active:
        solution, *_ = np.linalg.lstsq(design[:, active] * weights[:, None], target * weights,
                                       rcond=None)
        if (solution >= 0).all():
            coefficients[:] = 0.0
            coefficients[active] = solution
            break
        active.pop(int(np.argmin(solution)))  # the most negative one goes
    overhead, per_layer, per_check = (float(value) for value in coefficients)
    if per_layer <= 0.0:
        return None
    return CostModel(overhead_us=overhead, layer_us=per_layer, check_us=per_check,
                     num_layers=num_layers, tokens=total)
