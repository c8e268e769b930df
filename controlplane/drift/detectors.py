"""Drift detectors on exit behaviour: per-layer exit-rate change and shadow disagreement vs δ.

Exit rate at exit layer k is the *conditional* rate (exits at k / tokens that reached k), so a
collapse at an early layer does not show as a spike at the next one. `check_exit_rates` tests
one window of counts against the reference; `ExitRateMonitor` (and `detect_exit_rate_drift`,
which replays rollups through it) confirms ADWIN suspicions on fresh tokens and tests tumbling
windows. Both share one confirming test: a two-proportion z-test with a minimum absolute effect,
Holm or Bonferroni across layers, its standard error widened by each layer's design effect
(`controlplane.stats.clustered`; 1, the default, for i.i.d. streams). Findings are JSON-ready
(`DriftFinding.to_dict`), kinds as in the alert model. The detectors in detail:
docs/concepts/statistics.md, "Drift detection in detail".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from river.drift import ADWIN

from controlplane.alerts.kinds import AlertKind
from controlplane.stats.clustered import ClusteredProportion

# Short names for the kinds these statistics report (the definition is `AlertKind`).
EXIT_RATE_SPIKE = AlertKind.EXIT_RATE_SPIKE
EXIT_RATE_COLLAPSE = AlertKind.EXIT_RATE_COLLAPSE
QUALITY_REGRESSION = AlertKind.QUALITY_REGRESSION
DISTRIBUTION_DRIFT = AlertKind.DISTRIBUTION_DRIFT

# A spike puts quality at risk (fallback engages, unless the shadow tokens vouch for quality);
# a collapse only costs speed. Distribution drift alone informs (no page): it becomes a
# warning only when corroborated or persistent (`controlplane.drift.service`).
SEVERITY = {
    EXIT_RATE_SPIKE: "critical",
    EXIT_RATE_COLLAPSE: "warning",
    QUALITY_REGRESSION: "critical",
    DISTRIBUTION_DRIFT: "info",
}
DISTRIBUTION_DRIFT_ESCALATED = "warning"


@dataclass(frozen=True)
class LayerCounts:
    """Tokens that reached an exit layer and how many of them exited there."""

    tokens: int
    exits: int

    def __post_init__(self) -> None:
        # numpy integers from rollup queries would break JSON evidence later
        object.__setattr__(self, "tokens", int(self.tokens))
        object.__setattr__(self, "exits", int(self.exits))
        if not 0 <= self.exits <= self.tokens:
            raise ValueError(f"need 0 <= exits <= tokens, got {self.exits} of {self.tokens}")

    @property
    def rate(self) -> float:
        return self.exits / self.tokens if self.tokens else float("nan")


@dataclass(frozen=True)
class LayerReference:
    """Reference conditional exit rate; `tokens=None` means a known rate (no sampling error)."""

    rate: float
    tokens: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "rate", float(self.rate))
        if self.tokens is not None:
            object.__setattr__(self, "tokens", int(self.tokens))
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"reference exit rate must be in [0, 1], got {self.rate}")

    @classmethod
    def from_counts(cls, counts: LayerCounts) -> LayerReference:
        return cls(rate=counts.rate, tokens=counts.tokens)


@dataclass(frozen=True)
class DriftFinding:
    """One detected condition; `evidence` holds the test inputs and windows (JSON-serialisable)."""

    kind: str
    layer: int | None
    severity: str
    test: str
    statistic: float
    p_value: float
    adjusted_p_value: float
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def dedup_key(self) -> str:
        return f"{self.kind}:{'all' if self.layer is None else self.layer}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"dedup_key": self.dedup_key}


def holm_adjust(p_values: Sequence[float]) -> list[float]:
    """Holm step-down adjusted p-values (family-wise error control, any dependence)."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [1.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def adjust_p_values(p_values: Sequence[float], correction: str) -> list[float]:
    """Multiple-testing adjustment across layers: "holm" or "bonferroni"."""
    if correction == "holm":
        return holm_adjust(p_values)
    if correction == "bonferroni":
        return [min(1.0, p * len(p_values)) for p in p_values]
    raise ValueError(f"unknown correction {correction!r}; use 'holm' or 'bonferroni'")


def proportion_z_test(recent: LayerCounts, reference: LayerReference,
                      design_effect: float = 1.0) -> tuple[float, float]:
    """Two-sided z-test of the recent exit rate against the reference: (z, p-value).

    Pooled two-proportion test when the reference has counts, one-proportion test against a
    known rate otherwise (a known rate of 0 or 1 makes any deviation infinitely significant).
    The variance is multiplied by `design_effect` (clustered tokens carry less evidence).
    """
    n1, p1 = recent.tokens, recent.rate
    if n1 == 0:
        return 0.0, 1.0
    if reference.tokens is None:
        p0 = reference.rate
        se = math.sqrt(max(p0 * (1.0 - p0), 1e-12) / n1)
    else:
        n0 = reference.tokens
        pooled = (recent.exits + reference.rate * n0) / (n1 + n0)
        se = math.sqrt(pooled * (1.0 - pooled) * (1.0 / n1 + 1.0 / n0))
        p0 = reference.rate
    se *= math.sqrt(max(design_effect, 1.0))
    if se == 0.0:
        return 0.0, 1.0
    z = (p1 - p0) / se
    return z, math.erfc(abs(z) / math.sqrt(2.0))


def _cohens_h(p1: float, p0: float) -> float:
    return 2.0 * math.asin(math.sqrt(p1)) - 2.0 * math.asin(math.sqrt(p0))


def _reference_evidence(reference: LayerReference) -> dict[str, Any]:
    out: dict[str, Any] = {"rate": reference.rate, "tokens": reference.tokens}
    if reference.tokens is not None:
        out["exits"] = round(reference.rate * reference.tokens)
    return out


def _exit_rate_findings(
    tested: Sequence[tuple[int, LayerCounts, LayerReference, dict[str, Any]]],
    *,
    family_size: int,
    alpha: float,
    min_effect: float,
    correction: str,
    design_effect: Mapping[int, float] | None = None,
) -> list[DriftFinding]:
    """Test each (layer, recent, reference, extra evidence); untested family members count p=1."""
    effects = {layer: (design_effect or {}).get(layer, 1.0) for layer, *_ in tested}
    stats = [proportion_z_test(recent, ref, effects[layer]) for layer, recent, ref, _ in tested]
    p_values = [p for _, p in stats] + [1.0] * max(0, family_size - len(tested))
    adjusted = adjust_p_values(p_values, correction)
    findings = []
    for (layer, recent, ref, extra), (z, p), p_adj in zip(tested, stats, adjusted, strict=False):
        effect = recent.rate - ref.rate
        if p_adj > alpha or abs(effect) < min_effect:
            continue
        kind = EXIT_RATE_SPIKE if effect > 0 else EXIT_RATE_COLLAPSE
        evidence = {
            "reference": _reference_evidence(ref),
            "recent": {"tokens": recent.tokens, "exits": recent.exits, "rate": recent.rate},
            "effect": effect,
            "cohens_h": _cohens_h(recent.rate, ref.rate),
            "min_effect": min_effect,
            "alpha": alpha,
            "correction": correction,
            "hypotheses": family_size,
            "design_effect": effects[layer],
        } | extra
        test = "two_proportion_z" if ref.tokens is not None else "one_proportion_z"
        finding = DriftFinding(
            kind, layer, SEVERITY[kind], test, float(z), float(p), float(p_adj), evidence
        )
        findings.append(finding)
    return findings


def check_exit_rates(
    *,
    reference: Mapping[int, LayerReference],
    recent: Mapping[int, LayerCounts],
    alpha: float = 1e-4,
    min_effect: float = 0.05,
    correction: str = "holm",
    min_tokens: int = 30,
    window: Mapping[str, Any] | None = None,
    design_effect: Mapping[int, float] | None = None,
) -> list[DriftFinding]:
    """Exit-rate spikes/collapses of one recent window of counts vs the reference, per layer.

    A layer is reported when its corrected p-value is <= alpha and the absolute change of the
    conditional exit rate is >= min_effect. Layers with fewer than `min_tokens` recent tokens
    are not tested (but stay in the correction family). `window` (e.g. start/end timestamps)
    is copied into each finding's evidence.
    """
    tested = [
        (layer, counts, reference[layer], {"window": dict(window or {})})
        for layer, counts in sorted(recent.items())
        if layer in reference and counts.tokens >= min_tokens
    ]
    family = len([layer for layer in recent if layer in reference])
    return _exit_rate_findings(
        tested, family_size=family, alpha=alpha, min_effect=min_effect, correction=correction,
        design_effect=design_effect,
    )


def layer_counts_from_exits(
    exits: Mapping[int, int], total_tokens: int, exit_layers: Sequence[int]
) -> dict[int, LayerCounts]:
    """Reached/exited counts per exit layer from exits per layer and the total token count."""
    counts, reached = {}, total_tokens
    for layer in sorted(exit_layers):
        exited = int(exits.get(layer, 0))
        counts[layer] = LayerCounts(tokens=reached, exits=exited)
        reached -= exited
    return counts


def conditional_exit_rates(exit_shares: Mapping[int, float]) -> dict[int, float]:
    """Conditional exit rates from shares of all tokens exiting per layer (calibration output)."""
    rates, remaining = {}, 1.0
    for layer in sorted(exit_shares):
        share = exit_shares[layer]
        rates[layer] = share / remaining if remaining > 0 else 0.0
        remaining -= share
    return rates


@dataclass
class _LayerState:
    adwin: ADWIN
    reference: LayerReference | None
    warmup: list[int]  # reached, exited while learning the reference
    window: list[int]  # tumbling window: reached, exited
    confirm: list[int] | None = None  # fresh tokens since an ADWIN suspicion
    window_rollups: int = 0  # rollups the tumbling window spans (`update_counts`)
    firing: str | None = None


class ExitRateMonitor:
    """Streaming per-layer exit-rate change detection (ADWIN suspicion + confirming z-tests).

    Feed tokens with `update(exit_layers)`; each element is the layer a token exited at, or any
    value >= the last exit layer (e.g. num_layers) / None for a full-depth token. Every
    `check_every` tokens the monitor tests, as one corrected family of 2 x layers hypotheses:
    (1) per layer with an ADWIN alarm, the tokens seen *after* the alarm (at least `min_tokens`,
    given up after `confirm_tokens`) against the reference — fresh data, so the test is not
    biased by ADWIN's choice of cut; (2) per layer whose tumbling window of `window_tokens`
    reached tokens is full, that window against the reference. Without a given reference a layer
    learns it from its first `warmup_tokens` reached tokens. A layer that fired stays quiet
    until a full tumbling window no longer differs from the reference (then it resolves).

    Fed rollups (`update_counts`), a tumbling window also closes by time: after
    `window_rollups` rollups (minutes with traffic), once it holds the tokens a confirming test
    needs (`min_tokens`, or `min_expected_events` as below), so a thinly reached layer still
    gets its window tested. `design_effect` {layer: d} widens each layer's confirming test for
    clustered tokens; `min_expected_events` > 0 also holds a confirming test back until the
    fresh tokens' effective count would expect that many exits at the reference rate (the
    z-test's normal approximation is poor on a handful of rare exits).

    `update_counts` (one rollup at a time) shows ADWIN at most `adwin_max_per_rollup` evenly
    spread indicators per rollup and layer, each standing for its share of the rollup's tokens;
    the reference, tumbling window and confirming counts stay exact (why that loses nothing:
    docs/concepts/statistics.md, "Drift detection in detail").
    """

    def __init__(
        self,
        exit_layers: Sequence[int],
        *,
        reference: Mapping[int, LayerReference] | None = None,
        warmup_tokens: int = 2000,
        alpha: float = 1e-4,
        min_effect: float = 0.05,
        correction: str = "holm",
        adwin_delta: float = 0.002,
        check_every: int = 50,
        min_tokens: int = 30,
        confirm_tokens: int = 2000,
        window_tokens: int = 5000,
        design_effect: Mapping[int, float] | None = None,
        min_expected_events: float = 0.0,
        adwin_max_per_rollup: int = 128,
        window_rollups: int | None = None,
    ) -> None:
        self.exit_layers = sorted(exit_layers)
        self.alpha, self.min_effect, self.correction = alpha, min_effect, correction
        self.adwin_delta, self.check_every, self.min_tokens = adwin_delta, check_every, min_tokens
        self.warmup_tokens, self.confirm_tokens = warmup_tokens, confirm_tokens
        self.window_tokens = window_tokens
        self.design_effect = dict(design_effect or {})
        self.min_expected_events = min_expected_events
        self.adwin_max_per_rollup = adwin_max_per_rollup
        self.window_rollups = window_rollups
        self.tokens_seen = 0
        self._since_check = 0
        self._layers = {
            layer: _LayerState(
                adwin=ADWIN(delta=adwin_delta),
                reference=(reference or {}).get(layer),
                warmup=[0, 0],
                window=[0, 0],
            )
            for layer in self.exit_layers
        }

    @property
    def firing(self) -> dict[int, str]:
        """Layers currently in a detected state and their finding kind."""
        return {k: s.firing for k, s in self._layers.items() if s.firing is not None}

    @property
    def reference(self) -> dict[int, LayerReference | None]:
        return {k: s.reference for k, s in self._layers.items()}

    def update(self, exit_layers: Iterable[int | None]) -> list[DriftFinding]:
        """Feed tokens in order; returns findings that started firing during this call."""
        if isinstance(exit_layers, np.ndarray):
            values = exit_layers.astype(float).reshape(-1)
        else:
            values = np.array([math.inf if e is None else e for e in exit_layers], dtype=float)
        findings: list[DriftFinding] = []
        start = 0
        while start < len(values):
            stop = min(len(values), start + self.check_every - self._since_check)
            chunk = values[start:stop]
            for layer, state in self._layers.items():
                reached = chunk[chunk >= layer]
                self._feed(state, (reached == layer).astype(int).tolist())
            self.tokens_seen += len(chunk)
            self._since_check += len(chunk)
            if self._since_check >= self.check_every:
                findings += self._check()
                self._since_check = 0
            start = stop
        return findings

    def update_counts(self, counts: Mapping[int, LayerCounts]) -> list[DriftFinding]:
        """Feed one rollup (e.g. one minute) of per-layer counts; exits spread evenly in it."""
        for layer, state in self._layers.items():
            c = counts.get(layer)
            if c is None or c.tokens == 0:
                continue
            m = min(c.tokens, self.adwin_max_per_rollup)
            i = np.arange(m)
            pseudo_exits = round(c.exits * m / c.tokens)  # what ADWIN sees: m tokens, same rate
            spread = (i + 1) * pseudo_exits // m - i * pseudo_exits // m
            if m == c.tokens:
                self._feed(state, spread.tolist())
                continue
            tokens = (i + 1) * c.tokens // m - i * c.tokens // m  # what each one stands for
            exits = (i + 1) * c.exits // m - i * c.exits // m
            self._feed(state, spread.tolist(), tokens.tolist(), exits.tolist())
        for state in self._layers.values():
            if state.reference is not None:
                state.window_rollups += 1
        self.tokens_seen += max((c.tokens for c in counts.values()), default=0)
        self._since_check = 0
        return self._check()

    def _feed(self, state: _LayerState, indicators: list[int],
              tokens: list[int] | None = None, exits: list[int] | None = None) -> None:
        """ADWIN sees `indicators`; the counts add `tokens` / `exits` per indicator (by default
        one token each, exiting when its indicator is 1)."""
        adwin, confirm = state.adwin, state.confirm
        learning = state.reference is None
        for index, indicator in enumerate(indicators):
            adwin.update(indicator)
            n, exited = (1, indicator) if tokens is None else (tokens[index], exits[index])
            if learning:
                state.warmup[0] += n
                state.warmup[1] += exited
                if state.warmup[0] >= self.warmup_tokens:
                    state.reference = LayerReference.from_counts(LayerCounts(*state.warmup))
                    learning = False
                continue
            state.window[0] += n
            state.window[1] += exited
            if confirm is not None:
                confirm[0] += n
                confirm[1] += exited
            elif adwin.drift_detected and state.firing is None:
                confirm = state.confirm = [0, 0]

    def _confirm_tokens(self, layer: int, state: _LayerState) -> float:
        """Fresh tokens a confirming test needs at this layer."""
        if self.min_expected_events <= 0:
            return self.min_tokens
        rate = min(state.reference.rate, 1.0 - state.reference.rate)
        needed = self.min_expected_events * self.design_effect.get(layer, 1.0) / max(rate, 1e-3)
        return max(self.min_tokens, min(needed, self.confirm_tokens))

    def _window_closed(self, layer: int, state: _LayerState) -> bool:
        """The tumbling window is full: `window_tokens` reached tokens, or `window_rollups`
        rollups holding what a confirming test needs."""
        if state.window[0] >= self.window_tokens:
            return True
        return (self.window_rollups is not None and state.window_rollups >= self.window_rollups
                and state.window[0] >= self._confirm_tokens(layer, state))

    def _check(self) -> list[DriftFinding]:
        tested = []
        for layer, state in self._layers.items():
            if state.reference is None:
                continue
            if state.confirm is not None and state.confirm[0] >= self._confirm_tokens(layer,
                                                                                    state):
                extra = {
                    "trigger": "adwin",
                    "adwin_delta": self.adwin_delta,
                    "tokens_seen": self.tokens_seen,
                }
                tested.append((layer, LayerCounts(*state.confirm), state.reference, extra))
            if self._window_closed(layer, state):
                extra = {"trigger": "window", "tokens_seen": self.tokens_seen,
                         "window_rollups": state.window_rollups}
                tested.append((layer, LayerCounts(*state.window), state.reference, extra))
        findings = _exit_rate_findings(
            tested,
            family_size=2 * len(self._layers),
            alpha=self.alpha,
            min_effect=self.min_effect,
            correction=self.correction,
            design_effect=self.design_effect,
        )
        new = []
        for f in findings:
            state = self._layers[f.layer]
            if state.firing is None:
                state.firing = f.kind
                state.confirm = None
                new.append(f)
        fired = {f.layer for f in findings}
        for layer, state in self._layers.items():
            if state.reference is not None and self._window_closed(layer, state):
                back = abs(state.window[1] / state.window[0] - state.reference.rate) \
                    < self.min_effect
                if state.firing is not None and layer not in fired and back:
                    # a full window back at the reference resolves it; one that is merely
                    # not significant (a window straddling the change) does not
                    state.firing = None
                state.window = [0, 0]
                state.window_rollups = 0
            if state.confirm is not None and state.confirm[0] >= self.confirm_tokens:
                state.confirm = None  # suspicion not confirmed on fresh tokens: dismiss
        return new


def detect_exit_rate_drift(
    *,
    reference: Mapping[int, LayerReference],
    windows: Sequence[Mapping[int, LayerCounts]],
    **monitor_options: Any,
) -> list[DriftFinding]:
    """Replay per-minute rollups (oldest first) through an `ExitRateMonitor`.

    Returns the finding that made each still-firing layer fire (its evidence says when, in
    `tokens_seen`); layers that fired and came back are not returned. Made for a stateless
    periodic task: call it with the rollups since the version was activated.
    """
    exit_layers = sorted({layer for w in windows for layer in w} | set(reference))
    monitor = ExitRateMonitor(exit_layers, reference=reference, **monitor_options)
    latest: dict[int, DriftFinding] = {}
    for counts in windows:
        for finding in monitor.update_counts(counts):
            latest[finding.layer] = finding
    return [latest[layer] for layer in sorted(monitor.firing) if layer in latest]


def check_shadow_disagreement(
    *,
    disagreement: ClusteredProportion,
    delta: float,
    alpha: float = 1e-3,
    layer: int | None = None,
    window: Mapping[str, Any] | None = None,
) -> DriftFinding | None:
    """One-sided exact binomial test of H0: disagreement <= δ on the request-clustered shadow
    tokens' effective size (`controlplane.stats.clustered`); a `quality_regression` or None."""
    if disagreement.tokens <= 0:
        return None
    p_value = disagreement.p_value_above(delta)
    if p_value > alpha:
        return None
    evidence = {
        "shadow_tokens": disagreement.tokens,
        "disagreements": disagreement.events,
        "disagreement_rate": disagreement.rate,
        "requests": disagreement.clusters,
        "design_effect": disagreement.design_effect,
        "effective_tokens": disagreement.effective_tokens,
        "delta": delta,
        "alpha": alpha,
        "confidence_interval": [disagreement.lower_bound(alpha), disagreement.upper_bound(alpha)],
        "window": dict(window or {}),
    }
    return DriftFinding(
        QUALITY_REGRESSION,
        layer,
        SEVERITY[QUALITY_REGRESSION],
        "clustered_binomial_one_sided",
        disagreement.rate,
        p_value,
        p_value,
        evidence,
    )
