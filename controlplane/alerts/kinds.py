"""The kinds of alert, defined once: the detectors raise them, the store keeps their values, the
reaction registry (`controlplane.alerts.reactions`) maps them to what the system does.

Kept apart from the ORM so the statistics (plain functions, no database) can name them.
"""

from __future__ import annotations

from enum import StrEnum


class AlertKind(StrEnum):
    """What a detector observed; the value is what the `alerts.kind` column stores."""

    EXIT_RATE_COLLAPSE = "exit_rate_collapse"
    EXIT_RATE_SPIKE = "exit_rate_spike"
    QUALITY_REGRESSION = "quality_regression"
    # Whole answers under the active set differ from full depth more often than the
    # deployment's delta_answer allows, on its shadow requests (controlplane.drift.answers).
    ANSWER_REGRESSION = "answer_regression"
    DISTRIBUTION_DRIFT = "distribution_drift"
    RUNTIME_STALE = "runtime_stale"
    CANARY_FAILED = "canary_failed"
    # A runtime serves other exit heads or another model revision than its deployment names
    # (controlplane.runtimes.lineage): its evidence is set aside.
    RUNTIME_MISMATCH = "runtime_mismatch"
    RUNTIME_OUTLIER = "runtime_outlier"
    # Recent evidence certifies a set that saves substantially more than the active one at
    # the same δ (controlplane.flows.operating_curve): a finding, not a fault.
    OPPORTUNITY = "opportunity"


# Kinds that put answer quality at risk: the automatic fallback to a conservative set reacts to
# these (a spike only when the shadow tokens cannot vouch for quality).
QUALITY_AT_RISK = frozenset({AlertKind.QUALITY_REGRESSION, AlertKind.ANSWER_REGRESSION,
                             AlertKind.EXIT_RATE_SPIKE})

# Findings that never page: their alerts are kept and shown, and reach hooks that notify (webhook,
# Slack), never a pager (PagerDuty, Alertmanager).
NEVER_PAGES = frozenset({AlertKind.OPPORTUNITY})
