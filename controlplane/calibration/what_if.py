"""What a threshold set would do, evaluated on stored shadow evidence: per-layer and total exit
rate, disagreement with full depth and its upper bound at 1-ε (request-level, as calibration
tests), mean depth, and the predicted speed-up and net saving.

Plain functions on arrays; the flow that reads the window under the trust rules is
`controlplane.flows.what_if`, the live curve that evaluates every step of a threshold path is
`controlplane.calibration.curve`.

Cost: a served token that leaves at depth d computed the exit checks of the exit layers up to
d; a shadow token runs every layer and computes every check. With a fitted `CostModel` the
prediction is wall time (`token_us`) against a token at full depth without checks; without
one it is the layers ratio (`num_layers / mean depth`, checks and shadow tokens free) and the
answer says so (`cost_model` None).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from controlplane.calibration.learn_then_test import NEVER_EXIT, clustered_risk_upper_bound
from controlplane.stats.clustered import cluster_codes
from controlplane.stats.cost_model import CostModel
from controlplane.stats.exits import first_exit, passes


class InvalidThresholds(ValueError):
    """A hand-edited set that does not fit the deployment's exit layers."""


@dataclass(frozen=True)
class WhatIf:
    """One threshold set evaluated on one window's shadow evidence."""

    thresholds: dict[int, float]
    tokens: int  # shadow tokens evaluated (after the trust rules)
    requests: int
    witnesses: int
    exit_rate_by_layer: dict[int, float]  # share of all tokens leaving at each exit layer
    exit_rate: float
    disagreement: float  # share of tokens whose exit answer differs from full depth
    disagreement_bound: float  # upper bound at 1-ε, per request as calibration tests
    delta: float
    epsilon: float
    mean_depth: float
    mean_checks: float  # exit checks a served token computes, on average
    layers_speedup: float  # num_layers / mean depth
    speedup: float  # full-depth time / time per token (cost model), else the layers ratio
    net_saving: float  # share of full-depth time saved, net of checks and shadow tokens
    shadow_share: float  # share of tokens that ran as shadow tokens (full depth, every check)
    cost_model: dict | None  # the fitted model used; None: the layers ratio
    source: str = "set"  # "version", "set" or "calibration"
    version: int | None = None
    # answer consistency on the window's shadow requests (`calibration.answers`, with the
    # deployment's delta_answer); None without shadow requests
    answers: dict | None = None

    @property
    def certified(self) -> bool:
        """Whether the bound holds the set within δ at 1-ε."""
        return self.tokens > 0 and self.disagreement_bound <= self.delta

    def as_dict(self) -> dict:
        """JSON-ready (layer keys become strings)."""
        out = asdict(self)
        out["thresholds"] = {str(k): v for k, v in self.thresholds.items()}
        out["exit_rate_by_layer"] = {str(k): v for k, v in self.exit_rate_by_layer.items()}
        out["certified"] = self.certified
        return out


def validate_thresholds(thresholds: Mapping, exit_layers: Sequence[int]) -> dict[int, float]:
    """A hand-edited set as {exit layer: threshold}: every key one of `exit_layers`, every
    value in [0, 1]; layers not named never exit. InvalidThresholds says what is wrong."""
    layers = [int(layer) for layer in exit_layers]
    out = {layer: NEVER_EXIT for layer in layers}
    if not thresholds:
        raise InvalidThresholds(f"give at least one threshold, e.g. {{\"{layers[-1]}\": 0.9}} "
                                f"(exit layers: {', '.join(map(str, layers))})")
    for key, value in thresholds.items():
        try:
            layer = int(key)
        except (TypeError, ValueError):
            raise InvalidThresholds(f"threshold key {key!r} is not a layer number; use one of "
                                    f"the exit layers {', '.join(map(str, layers))}") from None
        if layer not in out:
            raise InvalidThresholds(f"layer {layer} is not an exit layer of this deployment; "
                                    f"use one of {', '.join(map(str, layers))}")
        try:
            threshold = float(value)
        except (TypeError, ValueError):
            raise InvalidThresholds(f"threshold of layer {layer} is not a number: "
                                    f"{value!r}") from None
        if not 0.0 <= threshold <= 1.0:
            raise InvalidThresholds(f"threshold of layer {layer} is {threshold}; a threshold "
                                    "lies in [0, 1] (1 never exits)")
        out[layer] = threshold
    return out


def exits_of(signals: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """Exit index per token (L: full depth); `thresholds` (L,) or one row per token (n, L),
    under the exit rule (`stats.exits`)."""
    return first_exit(np.atleast_2d(passes(signals, thresholds)))


def token_cost(first: np.ndarray, exit_layers: Sequence[int], num_layers: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """(depth, checks) per token leaving at exit index `first` (L: full depth): the layers it
    ran and the exit checks it computed (the exit layers up to its depth)."""
    layers = np.asarray(exit_layers, dtype=float)
    width = len(layers)
    depth = np.where(first < width, layers[np.minimum(first, width - 1)], float(num_layers))
    checks = np.where(first < width, first + 1.0, float(width))
    return depth, checks


def predicted_saving(mean_depth: float, mean_checks: float, *, num_layers: int,
                     exit_count: int, shadow_share: float, cost_model: CostModel | None
                     ) -> tuple[float, float]:
    """(speed-up, net saving) of served tokens at `mean_depth` and `mean_checks` with
    `shadow_share` of all tokens run as shadow tokens (full depth, `exit_count` checks). Without a
    cost model: the layers ratio, checks and shadow free."""
    if mean_depth <= 0:
        return 1.0, 0.0
    if cost_model is None:
        return num_layers / mean_depth, 1.0 - mean_depth / num_layers
    served = cost_model.token_us(mean_depth, mean_checks)
    shadow = cost_model.token_us(num_layers, exit_count)
    per_token = (1.0 - shadow_share) * served + shadow_share * shadow
    full = cost_model.full_depth_us
    return full / per_token, 1.0 - per_token / full


def request_losses(requests: np.ndarray | None, disagree: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(losses per request, tokens per request); no ids: each token its own request."""
    if requests is None or not len(disagree):
        return disagree.astype(float), np.ones(len(disagree))
    codes = cluster_codes(np.asarray(requests).astype(str))
    return (np.bincount(codes, weights=disagree.astype(float)),
            np.bincount(codes).astype(float))


def disagreement_bound(disagree: np.ndarray, requests: np.ndarray | None, epsilon: float
                       ) -> float:
    """Upper bound at 1-ε on the disagreement, request-level as calibration tests it (1 with
    no tokens)."""
    if not len(disagree):
        return 1.0
    losses, tokens = request_losses(requests, disagree)
    return float(clustered_risk_upper_bound(losses, tokens, epsilon)[0])


def evaluate(*, signals: np.ndarray, matched: np.ndarray, thresholds: np.ndarray | Mapping,
             exit_layers: Sequence[int], num_layers: int, delta: float, epsilon: float,
             requests: np.ndarray | None = None, witnesses: np.ndarray | None = None,
             cost_model: CostModel | None = None, shadow_share: float = 0.0,
             source: str = "set", version: int | None = None,
             label: Mapping[int, float] | None = None, bound: float | None = None) -> WhatIf:
    """Evaluate a threshold set on shadow tokens (signals, matched: (n, L) in exit-layer
    order). `thresholds`: {layer: threshold}, an (L,) vector or one row per token (n, L), as a
    set with a map per segment applies; `label` the set to report (default: `thresholds`);
    `bound` the disagreement bound when the caller computed it already."""
    layers = [int(layer) for layer in exit_layers]
    if isinstance(thresholds, Mapping):
        label = label or {int(k): float(v) for k, v in thresholds.items()}
        thresholds = np.array([float(thresholds.get(layer, thresholds.get(str(layer),
                                                                          NEVER_EXIT)))
                               for layer in layers])
    signals = np.asarray(signals, dtype=float).reshape(-1, len(layers))
    matched = np.asarray(matched, dtype=bool).reshape(-1, len(layers))
    n, width = signals.shape
    first = exits_of(signals, thresholds) if n else np.zeros(0, dtype=int)
    rows = np.arange(n)
    disagree = (first < width) & ~matched[rows, np.minimum(first, width - 1)] if n else \
        np.zeros(0, dtype=bool)
    depth, checks = token_cost(first, layers, num_layers)
    mean_depth = float(depth.mean()) if n else float(num_layers)
    mean_checks = float(checks.mean()) if n else float(width)
    speedup, saving = predicted_saving(mean_depth, mean_checks, num_layers=num_layers,
                                       exit_count=width, shadow_share=shadow_share,
                                       cost_model=cost_model)
    if label is None:
        vector = np.asarray(thresholds, dtype=float)
        label = ({} if vector.ndim != 1 else
                 {layer: float(t) for layer, t in zip(layers, vector, strict=True)})
    return WhatIf(
        thresholds=dict(label), tokens=n,
        requests=0 if requests is None else len(set(np.asarray(requests).tolist())),
        witnesses=0 if witnesses is None else len(set(np.asarray(witnesses).tolist())),
        exit_rate_by_layer={layer: float((first == j).mean()) if n else 0.0
                            for j, layer in enumerate(layers)},
        exit_rate=float((first < width).mean()) if n else 0.0,
        disagreement=float(disagree.mean()) if n else 0.0,
        disagreement_bound=(disagreement_bound(disagree, requests, epsilon) if bound is None
                            else float(bound)),
        delta=delta, epsilon=epsilon, mean_depth=mean_depth, mean_checks=mean_checks,
        layers_speedup=num_layers / mean_depth if mean_depth else 1.0, speedup=speedup,
        net_saving=saving, shadow_share=shadow_share,
        cost_model=None if cost_model is None else cost_model.as_dict(), source=source,
        version=version)
