"""What the adaptive shadow rate saves and what it costs in detection delay, simulated through the
real decision (`controlplane.flows.shadow_rate.needs_for`, `controlplane.deployments.shadow_rate
.decide`) and the real drift checks (`controlplane.drift.window_checks.quality_condition` on
the shadow tokens, `controlplane.drift.detectors.detect_exit_rate_drift` on per-minute counts of
every token), at the service's default settings.

A fleet serves `tokens_per_s` tokens in requests of `request_tokens`; at one exit layer a share
of them exits (the signal clears the threshold) and, of the shadow tokens the policy would let
out, some disagree with full depth. Each check (every drift interval) runs the two detectors
on what the runtimes sent; the adaptive fleet then applies the rate the control plane decides
from its recent traffic and the alerts firing (it reaches runtimes by long-poll, so from the
next token on); the fixed fleet keeps `fixed_rate` (the runtime server's default).

- `shadow_rate_reduction`: stable traffic, 1 - adaptive shadow tokens / fixed shadow tokens
  (after the first `warmup_s`, while the decision has no history yet).
- `drift_delay_ratio`: a quality drift of new traffic (the exit rate rises and so does the
  disagreement, as when heads meet a domain they were not trained on): mean delay from its
  onset to the first quality_regression, adaptive / fixed, over `trials` onsets.
- `quiet_drift_delay_ratio`: the same for a drift the exit rate does not show (the exit rate
  unchanged, only the disagreement rises): reported, not a target.

    .venv/bin/python -P bench/shadow_rate.py [--seed 0] [--trials 10]

prints one JSON line; `run(seed=...)` returns the same dict (bench/operating_curve.py calls it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controlplane.calibration.service import CalibrationPolicy
from controlplane.deployments.shadow_rate import decide
from controlplane.drift.detectors import (
    LayerCounts,
    LayerReference,
    detect_exit_rate_drift,
)
from controlplane.drift.window_checks import (
    DriftOptions,
    WindowInputs,
    quality_condition,
)
from controlplane.flows.shadow_rate import SCREEN_S, needs_for, screen
from controlplane.settings import Settings

LAYER, THRESHOLD = 8, 0.5
EPOCH = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Traffic:
    """The fleet's traffic: its rate, request length, exit rate and disagreement (shadow tokens
    the policy would let out that differ from full depth, per shadow token)."""

    tokens_per_s: float = 500.0
    request_tokens: int = 40
    exit_rate: float = 0.10
    disagreement: float = 0.005  # half of δ = 0.01, the deployments' default


@dataclass
class Fleet:
    """One fleet's sampling and what its checks saw."""

    adaptive: bool
    rate: float
    count_from: int = 0  # shadow tokens are counted from this second on
    shadow_tokens: int = 0
    detected_at: float | None = None
    exit_alert: bool = False


class Simulation:
    """Second by second traffic, checks every drift interval, for one fleet."""

    def __init__(self, *, fleet: Fleet, rng: np.random.Generator, options: DriftOptions,
                 calibration: CalibrationPolicy, settings: Settings, delta: float,
                 bounds: tuple[float, float]) -> None:
        self.fleet, self.rng, self.options = fleet, rng, options
        self.calibration, self.settings, self.delta, self.bounds = (calibration, settings,
                                                                    delta, bounds)
        self.served: list[int] = []  # tokens per second
        self.minutes: list[LayerCounts] = []  # per whole minute: at the exit layer
        self._minute = [0, 0]
        self.times: list[np.ndarray] = []  # shadow tokens: second, request, signal, matched
        self.requests: list[np.ndarray] = []
        self.disagree: list[np.ndarray] = []
        self.reference: dict[int, LayerReference] | None = None

    def second(self, t: int, traffic: Traffic) -> None:
        """Serve one second of `traffic` at the fleet's current rate."""
        n = int(self.rng.poisson(traffic.tokens_per_s))
        exits = int(self.rng.binomial(n, traffic.exit_rate))
        self.served.append(n)
        self._minute[0] += n
        self._minute[1] += exits
        if (t + 1) % 60 == 0:
            self.minutes.append(LayerCounts(*self._minute))
            self._minute = [0, 0]
        shadow = int(self.rng.binomial(n, self.fleet.rate))
        if shadow:
            if t >= self.fleet.count_from:
                self.fleet.shadow_tokens += shadow
            self.times.append(np.full(shadow, t + self.rng.random(), dtype=float))
            self.requests.append(self.rng.integers(0, max(1, n // traffic.request_tokens),
                                                   size=shadow) + t * 100_000)
            self.disagree.append(self.rng.random(shadow) < traffic.disagreement)

    def check(self, t: int) -> None:
        """One drift check at second `t`, then (adaptive) the control plane's decision."""
        now = EPOCH + timedelta(seconds=t)
        if self.reference is None and len(self.minutes) >= 10:  # learned once, as the service
            reached = sum(c.tokens for c in self.minutes)
            self.reference = {LAYER: LayerReference(
                rate=sum(c.exits for c in self.minutes) / reached, tokens=reached)}
        exit_alert = False
        if self.reference is not None:
            # The rollups of every minute since, the current one as far as it went (the
            # service reads them so).
            minutes = [*self.minutes[10:], LayerCounts(*self._minute)]
            findings = detect_exit_rate_drift(
                reference=self.reference, windows=[{LAYER: c} for c in minutes if c.tokens],
                alpha=self.options.exit_rate_level,
                window_rollups=self.options.exit_rate_window_min)
            exit_alert = bool(findings)
        quality = self._quality(now, t)
        if quality and self.fleet.detected_at is None:
            self.fleet.detected_at = float(t)
        self.fleet.exit_alert = exit_alert
        if self.fleet.adaptive:
            trouble = ("a quality_regression alert is firing" if quality else
                       "an exit_rate_spike alert is firing" if exit_alert else
                       self._screen(t))
            recent = self.served[-int(self.options.recent_s):]
            needs = needs_for(delta=self.delta, options=self.options,
                              calibration=self.calibration,
                              canary_min_tokens=self.settings.canary_min_shadow_tokens,
                              canary_window_s=self.settings.canary_interval_s, trouble=trouble,
                              canary_fraction=None)
            decision = decide(shadow_rate_min=self.bounds[0], shadow_rate_max=self.bounds[1],
                              tokens_per_s=sum(recent) / self.options.recent_s, needs=needs,
                              current=self.fleet.rate)
            self.fleet.rate = decision.rate

    def _screen(self, t: int) -> str | None:
        """The control plane's screen on the shadow tokens of the last whole minutes (as the
        rollups hold them)."""
        if not self.times:
            return None
        since = (t - SCREEN_S) // 60 * 60
        times = np.concatenate(self.times[-2000:])
        keep = times >= since
        disagree = np.concatenate(self.disagree[-2000:])[keep]
        return screen(shadow_tokens=int(keep.sum()), disagreements=int(disagree.sum()),
                      delta=self.delta)

    def _quality(self, now: datetime, t: int) -> bool:
        """Whether the quality test finds a regression on the recent window's shadow tokens."""
        if not self.times:
            return False
        times = np.concatenate(self.times)
        keep = times >= t - self.options.recent_s
        times = times[keep]
        disagree = np.concatenate(self.disagree)[keep]
        requests = np.concatenate(self.requests)[keep]
        # One exit layer: a disagreeing token exits (signal above the threshold) and does not
        # match full depth; the others stay (their match does not count).
        signals = np.where(disagree, 0.9, 0.1)[:, None]
        matched = (~disagree)[:, None]
        inputs = WindowInputs(
            version=2, layers=[LAYER], thresholds=[THRESHOLD], delta=self.delta, now=now,
            reference=None, reference_origin="", reference_window=None, since=now,
            minutes=[], recent_since=now - timedelta(seconds=self.options.recent_s),
            shadow_requests=[str(r) for r in requests], shadow_signals=signals,
            shadow_matched=matched, shadow_times=times + EPOCH.timestamp())
        return quality_condition(inputs, self.options) is not None


def simulate(*, adaptive: bool, phases: list[tuple[int, Traffic]], seed: int,
             delta: float = 0.01, fixed_rate: float = 0.05,
             bounds: tuple[float, float] = (0.01, 0.2), count_from: int = 0
             ) -> tuple[Fleet, list[int]]:
    """Run `phases` (seconds, traffic) for one fleet; the fleet and its served tokens."""
    settings = Settings()
    options = DriftOptions.from_settings(settings)
    fleet = Fleet(adaptive=adaptive, rate=bounds[1] if adaptive else fixed_rate,
                  count_from=count_from)
    sim = Simulation(fleet=fleet, rng=np.random.default_rng(seed), options=options,
                     calibration=CalibrationPolicy.from_settings(settings), settings=settings,
                     delta=delta, bounds=bounds)
    interval = int(options.check_interval_s)
    t = 0
    for seconds, traffic in phases:
        for _ in range(seconds):
            sim.second(t, traffic)
            t += 1
            if t % interval == 0:
                sim.check(t)
    return fleet, sim.served


def run(*, seed: int = 0, trials: int = 10, stable_s: int = 7200, warmup_s: int = 600,
        traffic: Traffic | None = None) -> dict:
    """The figures of the module docstring, as a dict."""
    started = time.perf_counter()
    base = traffic or Traffic()
    counts = {}
    for adaptive in (True, False):
        whole, _ = simulate(adaptive=adaptive, phases=[(warmup_s + stable_s, base)], seed=seed,
                            count_from=warmup_s)
        counts[adaptive] = whole.shadow_tokens
    loud = Traffic(base.tokens_per_s, base.request_tokens, exit_rate=0.25, disagreement=0.03)
    quiet = Traffic(base.tokens_per_s, base.request_tokens, exit_rate=base.exit_rate,
                    disagreement=0.03)
    delays: dict[tuple[str, bool], list[float]] = {}
    rng = np.random.default_rng(seed)
    for trial in range(trials):
        before = 1800 + int(rng.integers(0, 30))  # onsets anywhere between two checks
        for name, drifted in (("loud", loud), ("quiet", quiet)):
            for adaptive in (True, False):
                fleet, _ = simulate(adaptive=adaptive, phases=[(before, base), (900, drifted)],
                                    seed=seed * 1000 + trial)
                delay = 900.0 if fleet.detected_at is None else fleet.detected_at - before
                delays.setdefault((name, adaptive), []).append(max(delay, 0.0))
    mean = {key: float(np.mean(value)) for key, value in delays.items()}
    return {
        "shadow_rate_reduction": round(1 - counts[True] / counts[False], 4),
        "drift_delay_ratio": round(mean[("loud", True)] / mean[("loud", False)], 3),
        "quiet_drift_delay_ratio": round(mean[("quiet", True)] / mean[("quiet", False)], 3),
        "drift_delay_s": {"adaptive": round(mean[("loud", True)], 1),
                          "fixed": round(mean[("loud", False)], 1)},
        "quiet_drift_delay_s": {"adaptive": round(mean[("quiet", True)], 1),
                                "fixed": round(mean[("quiet", False)], 1)},
        "stable_shadow_tokens": {"adaptive": counts[True], "fixed": counts[False]},
        "stable_adaptive_rate": round(counts[True] / max(1, counts[False]) * 0.05, 4),
        "fixed_rate": 0.05, "stable_s": stable_s, "tokens_per_s": base.tokens_per_s, "delta": 0.01,
        "trials": trials, "seed": seed, "seconds": round(time.perf_counter() - started, 1),
        "command": f".venv/bin/python -P bench/shadow_rate.py --seed {seed} --trials {trials}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trials", type=int, default=10)
    args = parser.parse_args()
    print(json.dumps(run(seed=args.seed, trials=args.trials)))


if __name__ == "__main__":
    main()
