"""Request-level Learn-Then-Test: how often a true null is rejected when tokens come in
correlated requests (the figures in controlplane/calibration/learn_then_test.py's docstring).

Two simulations, seeded, no model or records needed:

1. `boundary`: the p-value alone at the null's boundary R = δ. Requests of 32 tokens whose
   disagreement rates are Beta with mean δ and intra-request correlation rho; per setting the
   share of draws with p <= ε for the token test, the request-level test reading its design
   effect on the tested requests only, and the product's (the larger of that reading and one on
   other requests). A valid p-value gives at most ε.
2. `end_to_end`: the whole calibrator (`calibrate_thresholds`, one exit layer, `shared` path,
   holdout 0.4) on `controlplane.stats.synthetic.correlated_requests`, repeated on fresh
   samples: the share of trials whose chosen threshold's true risk (on 20,000 requests) exceeds
   δ, token test vs request-level test, and the mean exit rate of each.

Figures (2026-11-30, loaded 2-core box, the defaults: δ 0.05, ε 0.1, 2,000 draws, 100 trials,
140 s; controlplane/calibration/learn_then_test.py's docstring quotes them):

boundary, P(p <= ε) at R = δ     token      test's own reading   product (larger reading)
  12 requests, rho 0.03-0.67     0.17-0.49  0.11-0.40            0.07-0.24  (does not hold)
  34 requests                    0.15-0.43  0.11-0.21            0.074-0.081
  100 requests                   0.17-0.42  0.12-0.16            0.078-0.090
  (`--epsilon 0.045 --trials 0 --draws 4000`: 34 requests 0.037-0.051 up to rho 0.25, 0.066
  at 0.67; 100 requests 0.037-0.041)

end to end, violation rate       token      request-level        exit rate token -> request
  20-50 requests                 0.18-0.28  0.06-0.16            0.42-0.67 -> 0.31-0.63
  100-200 requests               0.15-0.26  0.04-0.07            0.43-0.68 -> 0.37-0.66

    .venv/bin/python -P bench/request_level_ltt.py
    .venv/bin/python -P bench/request_level_ltt.py --trials 100 --draws 4000
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from controlplane.calibration.learn_then_test import (
    binomial_p_value,
    calibrate_thresholds,
    clustered_risk_p_values,
)
from controlplane.stats.synthetic import correlated_requests

SIZE = 32


def _beta_binomial(rng, draws: int, requests: int, *, delta: float, rho: float) -> np.ndarray:
    """(draws, requests) disagreements of SIZE-token requests whose rates are Beta with mean δ
    and intra-request correlation rho."""
    concentration = 1.0 / rho - 1.0
    rates = rng.beta(delta * concentration, (1 - delta) * concentration, size=(draws, requests))
    return rng.binomial(SIZE, rates)


def boundary(*, draws: int, delta: float, epsilon: float, seed: int) -> list[dict]:
    """Rejection rates of a true null (R = δ) per (tested, other requests, correlation)."""
    rng = np.random.default_rng(seed)
    rows = []
    for tested, others in ((12, 8), (34, 26), (100, 80)):
        for rho in (0.03, 0.09, 0.25, 0.67):
            mine = _beta_binomial(rng, draws, tested, delta=delta, rho=rho)
            other = _beta_binomial(rng, draws, others, delta=delta, rho=rho)
            sizes = np.full(tested, SIZE)
            token = binomial_p_value(mine.sum(axis=1), tested * SIZE, delta)
            alone = clustered_risk_p_values(mine, sizes, delta, alpha=epsilon)[0]
            product = clustered_risk_p_values(mine, sizes, delta, alpha=epsilon,
                                              reference=(other, np.full(others, SIZE)))[0]
            rows.append({"requests": tested, "other_requests": others, "correlation": rho,
                         "token": float(np.mean(token <= epsilon)),
                         "tested_reading_only": float(np.mean(alone <= epsilon)),
                         "request_level": float(np.mean(product <= epsilon))})
    return rows


def end_to_end(*, trials: int, delta: float, epsilon: float, seed: int) -> list[dict]:
    """Violation rate of the calibrator's chosen threshold, token vs request-level test."""
    rng = np.random.default_rng(seed)
    grid = np.linspace(1.0, 0.0, 101)
    rows = []
    for effect in (1.5, 3.0):
        population_s, population_m, _ = correlated_requests(20_000, rng=rng,
                                                            request_effect=effect)
        true_risk = np.array([((population_s[:, 0] > t) & ~population_m[:, 0]).mean()
                              for t in grid])
        for requests in (20, 50, 100, 200):
            violations = {"token": 0, "request": 0}
            exits = {"token": [], "request": []}
            for trial in range(trials):
                signals, matched, ids = correlated_requests(requests, rng=rng,
                                                            request_effect=effect)
                for unit, given in (("token", None), ("request", ids)):
                    result = calibrate_thresholds(
                        signals=signals, matched=matched, exit_layers=[4], num_layers=8,
                        delta=delta, epsilon=epsilon, strategy="shared", grid=grid,
                        holdout_fraction=0.4, min_samples_per_layer=10, requests=given,
                        seed=trial)
                    threshold = result.thresholds[4]
                    risk = (0.0 if threshold >= 1.0
                            else true_risk[np.argmin(np.abs(grid - threshold))])
                    violations[unit] += risk > delta
                    exits[unit].append(result.exit_rate)
            rows.append({"requests": requests, "request_effect": effect,
                         "token_violation_rate": violations["token"] / trials,
                         "request_violation_rate": violations["request"] / trials,
                         "token_exit_rate": float(np.mean(exits["token"])),
                         "request_exit_rate": float(np.mean(exits["request"]))})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=2000, help="p-value draws per setting")
    parser.add_argument("--trials", type=int, default=100,
                        help="calibrations per setting (0: the boundary part only)")
    parser.add_argument("--delta", type=float, default=0.05)
    parser.add_argument("--epsilon", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print("command:", " ".join([sys.executable, *sys.argv]), flush=True)
    started = time.perf_counter()
    report = {
        "delta": args.delta, "epsilon": args.epsilon, "draws": args.draws,
        "trials": args.trials,
        "boundary": boundary(draws=args.draws, delta=args.delta, epsilon=args.epsilon,
                             seed=args.seed),
        "end_to_end": end_to_end(trials=args.trials, delta=args.delta, epsilon=args.epsilon,
                                 seed=args.seed) if args.trials > 0 else [],
    }
    report["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
