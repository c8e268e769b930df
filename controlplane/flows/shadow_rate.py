"""What each consumer of shadow tokens needs, from the deployment's state, and the shadow rate
that follows (`controlplane.deployments.shadow_rate.decide`), stored for delivery.

Needs (`needs_for`), each within its window:

- the quality drift test: enough shadow tokens over the longest quality window to detect a
  disagreement of 2δ against δ at its per-look level with 80% power (one-sided normal
  approximation to its binomial test, times the design effect; at least `min_shadow_tokens`);
- calibration: `calibration_min_samples` per exit layer (every shadow token labels every exit
  layer) over the calibration lookback;
- while the deployment is in trouble (a drift alert firing, a fallback set active, or the
  shadow tokens of the last `SCREEN_S` seconds already suggesting a disagreement above δ at
  the lenient `SCREEN_ALPHA`, before the quality test can say so): the quality test's tokens
  over its *shortest* window, so a regression is confirmed (or cleared) at the first looks;
- an open canary: `canary_min_shadow_tokens` per canary window from the canary's fraction of
  the traffic.

Served traffic and the screen's shadow counts are read from the rollups (tokens checked at the
first exit layer over the recent window; shadow tokens and the policy's disagreements of the
last minutes): small aggregates per deployment, in the workers, never at request time.
"""

from __future__ import annotations

import math
from datetime import timedelta
from statistics import NormalDist

from scipy.stats import binom
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controlplane.alerts.models import Alert
from controlplane.calibration.service import CalibrationPolicy
from controlplane.db import utcnow
from controlplane.deployments import shadow_rate
from controlplane.deployments.models import Alias, Deployment, ThresholdSet
from controlplane.drift.detectors import (
    DISTRIBUTION_DRIFT,
    EXIT_RATE_COLLAPSE,
    EXIT_RATE_SPIKE,
    QUALITY_REGRESSION,
)
from controlplane.drift.window_checks import DriftOptions
from controlplane.telemetry.models import Rollup
from exitplane.wire import Origin

DRIFT_KINDS = tuple(str(kind.value) for kind in (QUALITY_REGRESSION, EXIT_RATE_SPIKE,
                                                 EXIT_RATE_COLLAPSE, DISTRIBUTION_DRIFT))
POWER = 0.8  # of the quality test against a disagreement of twice δ
# The screen that raises the rate at the first sign of a regression: the last SCREEN_S seconds
# of shadow tokens, tested one-sided against δ at SCREEN_ALPHA (lenient: it pages nobody, it
# only buys the quality test its tokens sooner).
SCREEN_S = 60.0
SCREEN_ALPHA = 0.01


def screen(*, shadow_tokens: int, disagreements: int, delta: float,
           alpha: float = SCREEN_ALPHA) -> str | None:
    """Why the recent shadow tokens suggest a disagreement above δ (binomial, one-sided), or
    None when they do not."""
    if shadow_tokens <= 0 or disagreements <= delta * shadow_tokens:
        return None
    p_value = float(binom.sf(disagreements - 1, shadow_tokens, delta))
    if p_value >= alpha:
        return None
    return (f"the last shadow tokens disagree {disagreements}/{shadow_tokens} above "
            f"δ={delta:g} (p={p_value:.2g})")


def quality_tokens(*, delta: float, alpha: float, design_effect: float = 1.0,
                   power: float = POWER, minimum: int = 0) -> float:
    """Shadow tokens the one-sided test of `disagreement <= delta` at level `alpha` needs to
    reject with probability `power` when the disagreement is 2δ (normal approximation)."""
    p0, p1 = delta, min(2 * delta, 0.999)
    z_alpha, z_power = NormalDist().inv_cdf(1 - alpha), NormalDist().inv_cdf(power)
    n = ((z_alpha * math.sqrt(p0 * (1 - p0)) + z_power * math.sqrt(p1 * (1 - p1)))
         / (p1 - p0)) ** 2
    return max(n * design_effect, float(minimum))


def needs_for(*, delta: float, options: DriftOptions, calibration: CalibrationPolicy,
              canary_min_tokens: int, canary_window_s: float, trouble: str | None,
              canary_fraction: float | None) -> list[shadow_rate.ShadowNeed]:
    """The needs of a deployment in this state (module docstring); `trouble` names why the
    quality test must decide fast (None: stable), `canary_fraction` an open canary's share."""
    tokens = quality_tokens(delta=delta, alpha=options.quality_look_alpha,
                            design_effect=options.default_design_effect,
                            minimum=options.min_shadow_tokens)
    windows = sorted(min(w, options.recent_s) for w in options.quality_windows_s)
    needs = [shadow_rate.ShadowNeed("the quality drift test", tokens, windows[-1]),
             shadow_rate.ShadowNeed("calibration", calibration.min_samples_per_layer,
                                    calibration.lookback.total_seconds())]
    if trouble is not None:
        needs.append(shadow_rate.ShadowNeed(f"{trouble}: the quality test's shortest window",
                                            tokens, windows[0]))
    if canary_fraction:
        needs.append(shadow_rate.ShadowNeed("the open canary", canary_min_tokens,
                                            canary_window_s, share=canary_fraction))
    return needs


def tokens_per_s(*, session: Session, deployment: Deployment, window_s: float) -> float:
    """Served tokens per second over the last `window_s` seconds (rollups, whole minutes)."""
    since = utcnow() - timedelta(seconds=window_s)
    total = session.scalar(select(func.coalesce(func.sum(Rollup.tokens), 0)).where(
        Rollup.deployment_id == deployment.id, Rollup.layer == min(deployment.exit_layers),
        Rollup.minute >= since))
    return float(total or 0) / window_s


def recent_disagreement(*, session: Session, deployment: Deployment, window_s: float
                        ) -> tuple[int, int]:
    """(shadow tokens, their disagreements under the policy) in the rollups of the minutes
    that the last `window_s` seconds touch (the current one as far as it went): every shadow
    token is labelled at the first exit layer and disagrees at most at one layer."""
    since = (utcnow() - timedelta(seconds=window_s)).replace(second=0, microsecond=0)
    first = min(deployment.exit_layers)
    row = session.execute(select(
        func.coalesce(func.sum(Rollup.shadow_total).filter(Rollup.layer == first), 0),
        func.coalesce(func.sum(Rollup.policy_mismatches), 0)).where(
        Rollup.deployment_id == deployment.id, Rollup.minute >= since)).one()
    return int(row[0]), int(row[1])


def trouble_of(*, session: Session, deployment: Deployment, active: ThresholdSet | None
               ) -> str | None:
    """Why the quality test must decide fast: a firing drift alert, a fallback set active, or
    the screen (module docstring); None when the deployment is stable."""
    kind = session.scalar(select(Alert.kind).where(
        Alert.deployment_id == deployment.id, Alert.status == "firing",
        Alert.kind.in_(DRIFT_KINDS)).order_by(Alert.id.desc()).limit(1))
    if kind is not None:
        return f"a {kind} alert is firing"
    if active is not None and active.origin == Origin.fallback.value:
        return f"a fallback set (v{active.version}) is active"
    shadow, disagreements = recent_disagreement(session=session, deployment=deployment,
                                                window_s=SCREEN_S)
    return screen(shadow_tokens=shadow, disagreements=disagreements, delta=deployment.delta)


def decide_for(*, session: Session, deployment: Deployment, options: DriftOptions,
               calibration: CalibrationPolicy, settings) -> shadow_rate.ShadowDecision:
    """Decide the deployment's shadow rate now and store it (announced when it changed)."""
    aliases = dict(session.execute(select(Alias.name, Alias.version)
                                   .where(Alias.deployment_id == deployment.id)).all())
    active = session.scalar(select(ThresholdSet).where(
        ThresholdSet.deployment_id == deployment.id,
        ThresholdSet.version == aliases.get("active", -1)))
    canary = aliases.get("canary")
    open_canary = canary is not None and canary != aliases.get("active")
    needs = needs_for(delta=deployment.delta, options=options, calibration=calibration,
                      canary_min_tokens=settings.canary_min_shadow_tokens,
                      canary_window_s=settings.canary_interval_s,
                      trouble=trouble_of(session=session, deployment=deployment, active=active),
                      canary_fraction=deployment.canary_fraction if open_canary else None)
    decision = shadow_rate.decide(
        shadow_rate_min=deployment.shadow_rate_min, shadow_rate_max=deployment.shadow_rate_max,
        tokens_per_s=tokens_per_s(session=session, deployment=deployment,
                                  window_s=options.recent_s),
        needs=needs, current=deployment.shadow_rate)
    shadow_rate.record(session=session, deployment=deployment, decision=decision)
    return decision
