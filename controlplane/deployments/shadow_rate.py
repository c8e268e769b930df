"""The shadow rate a deployment's runtimes apply: decided by the control plane, within the
operator's bounds, and delivered with the threshold set (controlplane/deployments/delivery.py).

A shadow token runs to full depth, so watching quality costs what early exit would have
saved on it. The rate is the smallest that gives each consumer of shadow tokens what it needs
within its window (`ShadowNeed`: the quality drift test's power, the calibration minimum, an
open canary's windows), times a headroom for traffic that varies, and more while the
deployment is in trouble (a firing drift alert, a fallback set active): then the quality test
must decide on its shortest window. The consumers are sized by `controlplane.flows.shadow_rate`
(it reads drift, alert and canary state, which this layer may not); this module decides from
numbers and stores what it decided and why.

Bounds: `shadow_rate_min` <= rate <= `shadow_rate_max`; equal bounds fix the rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sqlalchemy.orm import Session

from controlplane.coordination.bus import notify_after_commit
from controlplane.db import utcnow
from controlplane.deployments.models import Deployment

# Traffic varies within a window: the rate asks for this much more than the mean would need.
HEADROOM = 1.5
# A decided rate is kept while what is needed lies within [KEEP_BELOW x rate, rate]: runtimes
# are not sent a new rate on every check for a small change in traffic.
KEEP_BELOW = 0.6
REASON_MAX = 500


@dataclass(frozen=True)
class ShadowNeed:
    """One consumer of shadow tokens: it needs `tokens` of them within `window_s` seconds,
    drawn from a `share` of the deployment's traffic (a canary sees its fraction only)."""

    name: str
    tokens: float
    window_s: float
    share: float = 1.0

    def rate(self, tokens_per_s: float) -> float:
        """The shadow rate that gives this need its tokens at `tokens_per_s` of traffic."""
        supply = tokens_per_s * self.window_s * self.share
        return math.inf if supply <= 0 else HEADROOM * self.tokens / supply


@dataclass(frozen=True)
class ShadowDecision:
    """A shadow rate and why it was chosen."""

    rate: float
    reason: str


def decide(*, shadow_rate_min: float, shadow_rate_max: float, tokens_per_s: float,
           needs: list[ShadowNeed], current: float | None = None) -> ShadowDecision:
    """The rate that meets every need within the bounds (module docstring); `current`, the
    rate decided before, is kept while it meets them without exceeding them by much."""
    low, high = shadow_rate_min, shadow_rate_max
    if low >= high:
        return ShadowDecision(high, f"fixed by the operator at {high:g}")
    if tokens_per_s <= 0:
        return ShadowDecision(high, "no recent traffic: the highest rate the bounds allow, so "
                                    "the first tokens are watched")
    wanted, driver = 0.0, None
    for need in needs:
        rate = need.rate(tokens_per_s)
        if rate > wanted:
            wanted, driver = rate, need
    target = min(max(wanted, low), high)
    rate = _rounded(target)
    if current is not None and low <= current <= high and KEEP_BELOW * current <= target \
            <= current:
        rate = current
    if driver is None:
        return ShadowDecision(rate, "nothing needs shadow tokens")
    why = (f"{driver.name} needs {driver.tokens:.0f} shadow tokens per {driver.window_s:g} s"
           + (f" from {driver.share:.0%} of the traffic" if driver.share < 1 else "")
           + f" at {tokens_per_s:.3g} tokens/s: {wanted:.3g} with headroom")
    if wanted > high:
        why += f", capped at the bound {high:g}"
    elif wanted < low:
        why += f", raised to the bound {low:g}"
    return ShadowDecision(rate, why[:REASON_MAX])


def _rounded(rate: float) -> float:
    """Two significant digits, rounded up (a rate never falls below what was asked)."""
    if rate <= 0:
        return 0.0
    scale = 10 ** (math.floor(math.log10(rate)) - 1)
    return min(1.0, round(math.ceil(round(rate / scale, 9)) * scale, 10))


def record(*, session: Session, deployment: Deployment, decision: ShadowDecision) -> bool:
    """Store `decision` on the deployment; a changed rate is announced to the config caches
    and long-polls after the commit (as an alias move is). True when the rate changed."""
    rate = round(decision.rate, 6)
    changed = deployment.shadow_rate != rate
    deployment.shadow_rate = rate
    deployment.shadow_rate_reason = decision.reason[:REASON_MAX]
    deployment.shadow_rate_decided_at = utcnow()
    if changed:
        notify_after_commit(session=session, topic="config", message=deployment.name)
    session.flush()
    return changed


def bounds_changed(*, session: Session, deployment: Deployment) -> None:
    """After the operator set the bounds: a fixed rate applies at once; a decided rate outside
    the new bounds is moved inside them (the workers refine it at their next check)."""
    low, high = deployment.shadow_rate_min, deployment.shadow_rate_max
    if low >= high:
        record(session=session, deployment=deployment,
               decision=ShadowDecision(high, f"fixed by the operator at {high:g}"))
    elif deployment.shadow_rate is not None and not low <= deployment.shadow_rate <= high:
        rate = min(max(deployment.shadow_rate, low), high)
        record(session=session, deployment=deployment, decision=ShadowDecision(
            rate, f"moved within the operator's bounds [{low:g}, {high:g}]"))
