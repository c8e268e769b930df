"""The operating curve: the quality-vs-speed-up frontier of recent shadow evidence, the sets a
deployment holds marked on it, the best set certified at δ and what is left on the table.

The frontier is the calibration's own threshold path (`learn_then_test.calibrate_thresholds`
on the window at the deployment's δ and ε): each step evaluated on the whole window
(`what_if.evaluate`: exit rate, disagreement and its upper bound at 1-ε, mean depth, predicted
speed-up and net saving). The best certified step is the one the calibration chooses. The gap
is its net saving (and speed-up) minus the active set's.

An opportunity (`Opportunity`) is a gap that is certain, not a gap that sampling noise
explains: the best step's bound on the whole window holds it within δ, and the gain in net
saving stays at least `min_gain` times the active set's saving (at least `min_gain` squared
of full-depth time) at the gain's lower confidence bound (requests as clusters). On stationary
traffic the active set was certified on the same distribution, so the gain is noise and does
not qualify.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from controlplane.calibration.learn_then_test import (
    CalibrationResult,
    clustered_risk_upper_bound,
)
from controlplane.calibration.what_if import evaluate, exits_of, token_cost
from controlplane.stats.clustered import cluster_codes
from controlplane.stats.cost_model import CostModel

# Most points a stored curve keeps (the chosen step and both ends always).
MAX_POINTS = 60
# One-sided normal quantile of the gain's lower bound (0.5%).
GAIN_Z = 2.576


@dataclass(frozen=True)
class Opportunity:
    """Whether the best certified set saves enough more than the active one, beyond noise."""

    gain: float  # net saving of the best certified set minus the active set's
    gain_lower: float  # its lower confidence bound (requests as clusters)
    required: float  # what the gain must reach
    best_certified: bool  # the best step's bound on the whole window is within δ
    qualifies: bool

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class OperatingCurve:
    """One window's frontier with the deployment's sets on it (module docstring)."""

    points: list[dict]  # conservative first: thresholds, exit_rate, disagreement, bound, ...
    marks: dict[str, dict]  # alias name -> its point (with its version)
    best: dict | None  # the step certified at δ that the calibration chooses
    gap: dict | None  # {"net_saving", "speedup"}: best minus active
    opportunity: Opportunity | None
    tokens: int
    requests: int
    witnesses: int

    def as_dict(self) -> dict:
        out = asdict(self)
        out["opportunity"] = None if self.opportunity is None else self.opportunity.as_dict()
        return out


def _point(result, **extra) -> dict:
    """A what-if result as a stored curve point."""
    keep = ("thresholds", "exit_rate", "exit_rate_by_layer", "disagreement",
            "disagreement_bound", "mean_depth", "layers_speedup", "speedup", "net_saving")
    body = result.as_dict()
    return {key: body[key] for key in keep} | extra


def _thin(count: int, chosen: int) -> list[int]:
    """Indices of at most MAX_POINTS steps, evenly spread, with the ends and `chosen`."""
    if count <= MAX_POINTS:
        return list(range(count))
    picked = set(np.linspace(0, count - 1, MAX_POINTS - 1).round().astype(int).tolist())
    return sorted(picked | {chosen})


def step_bounds(signals: np.ndarray, matched: np.ndarray, path: np.ndarray,
                requests: np.ndarray, epsilon: float) -> np.ndarray:
    """Each step's disagreement bound at 1-ε on the whole window, per request (one search for
    every step)."""
    codes = cluster_codes(np.asarray(requests).astype(str))
    width = signals.shape[1]
    rows = np.arange(len(signals))
    losses = []
    for thresholds in path:
        first = exits_of(signals, thresholds)
        disagree = (first < width) & ~matched[rows, np.minimum(first, width - 1)]
        losses.append(np.bincount(codes, weights=disagree.astype(float)))
    return clustered_risk_upper_bound(np.array(losses), np.bincount(codes).astype(float),
                                      epsilon)


def saving_gain(*, signals: np.ndarray, requests: np.ndarray, best: np.ndarray,
                active: np.ndarray, exit_layers: Sequence[int], num_layers: int,
                cost_model: CostModel | None, shadow_share: float) -> tuple[float, float]:
    """(gain, its standard error) in net saving of `best` over `active` on these tokens, with
    requests as clusters (a ratio estimator's variance)."""
    def saving(thresholds):
        depth, checks = token_cost(exits_of(signals, thresholds), exit_layers, num_layers)
        if cost_model is None:
            return 1.0 - depth / num_layers
        return 1.0 - (cost_model.overhead_us + cost_model.layer_us * depth
                      + cost_model.check_us * checks) / cost_model.full_depth_us

    # shadow tokens cost the same under both sets; the layers ratio counts them free
    diff = (saving(best) - saving(active)) * (1.0 if cost_model is None else 1.0 - shadow_share)
    codes = cluster_codes(np.asarray(requests).astype(str))
    sums, sizes = np.bincount(codes, weights=diff), np.bincount(codes).astype(float)
    total, clusters = float(sizes.sum()), len(sizes)
    gain = float(sums.sum() / total)
    if clusters < 2:
        return gain, float("inf")
    residual = sums - gain * sizes
    error = float(np.sqrt(clusters / (clusters - 1) * np.sum(residual ** 2)) / total)
    return gain, error


def operating_curve(*, signals: np.ndarray, matched: np.ndarray, requests: np.ndarray,
                    witnesses: np.ndarray, calibration: CalibrationResult,
                    exit_layers: Sequence[int], num_layers: int, delta: float,
                    epsilon: float, marks: Mapping[str, tuple[int, Mapping[int, float]]],
                    cost_model: CostModel | None = None, shadow_share: float = 0.0,
                    min_gain: float = 0.10) -> OperatingCurve:
    """The frontier along `calibration`'s path on this window's shadow tokens, with `marks`
    (name -> (version, {layer: threshold})) evaluated on the same tokens."""
    layers = [int(layer) for layer in exit_layers]
    common = dict(signals=signals, matched=matched, exit_layers=layers, num_layers=num_layers,
                  delta=delta, epsilon=epsilon, requests=requests, witnesses=witnesses,
                  cost_model=cost_model, shadow_share=shadow_share)
    steps = calibration.curve
    chosen = next((i for i, step in enumerate(steps) if step.chosen), 0)
    path = np.array([[step.thresholds[layer] for layer in layers] for step in steps])
    bounds = step_bounds(signals, matched, path, requests, epsilon)
    points = []
    for i in _thin(len(steps), chosen):
        step = steps[i]
        found = evaluate(thresholds=path[i], label=step.thresholds, bound=float(bounds[i]),
                         **common)
        points.append(_point(found, step=i, test_bound=step.risk_bound, certified=step.certified,
                             chosen=step.chosen))
    best = next(point for point in points if point["chosen"])
    marked = {}
    for name, (version, thresholds) in marks.items():
        found = evaluate(thresholds={int(k): float(v) for k, v in thresholds.items()},
                         **common)
        marked[name] = _point(found, version=version)
    active = marked.get("active")
    gap = opportunity = None
    if active is not None:
        gap = {"net_saving": best["net_saving"] - active["net_saving"],
               "speedup": best["speedup"] - active["speedup"]}
        gain, error = saving_gain(
            signals=signals, requests=requests, best=path[chosen],
            active=np.array([active["thresholds"].get(str(layer), 1.0) for layer in layers]),
            exit_layers=layers, num_layers=num_layers, cost_model=cost_model,
            shadow_share=shadow_share)
        required = min_gain * max(active["net_saving"], min_gain)
        certified = chosen > 0 and best["disagreement_bound"] <= delta
        lower = gain - GAIN_Z * error
        opportunity = Opportunity(gain=gain, gain_lower=lower, required=required,
                                  best_certified=certified,
                                  qualifies=bool(certified and lower >= required))
    return OperatingCurve(points=points, marks=marked, best=best, gap=gap,
                          opportunity=opportunity, tokens=len(signals),
                          requests=len(set(np.asarray(requests).tolist())),
                          witnesses=len(set(np.asarray(witnesses).tolist())))
