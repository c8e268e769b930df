"""Outlier witnesses: a witness (a runtime, or the credential that vouches for its evidence) whose
shadow evidence differs from the rest of its fleet beyond chance is set aside (`runtime_outlier`)
until an operator clears it.

Each drift cycle compares every witness with the rest pooled, per segment, on families of
request-clustered rates it cannot hide (agreement per layer, signal above the rest's median,
agreement by signal band, the active policy's disagreement), a chi-square per family at the
drift false-alarm budget. The most significant witness is peeled off while any differs from the
rest of those left; with no clear majority nobody is set aside. The tests, and why each family:
docs/concepts/statistics.md, "Outlier witnesses".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

import numpy as np
from scipy.stats import chi2
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.alerts.kinds import AlertKind
from controlplane.alerts.service import Condition, fire
from controlplane.deployments.models import Deployment
from controlplane.drift.window_checks import DriftOptions
from controlplane.runtimes.models import Runtime, RuntimeOutlier
from controlplane.runtimes.outliers import excluded_witnesses, set_aside
from controlplane.runtimes.witnesses import RUNTIME_PREFIX, token_of
from controlplane.stats.clustered import cluster_codes, null_design_effect
from controlplane.stats.exits import policy_outcomes
from controlplane.stats.robust_evidence import cap_runtime_share
from controlplane.telemetry.service import shadow_evidence
from exitplane.wire import DEFAULT_SEGMENT

STATISTICS = ("policy_disagreement", "matched", "signal_above_median", "matched_by_signal")
# a floor on the eigenvalues of a correlation between exit layers: a direction the fleet's
# evidence says never varies is still given this much room (conservative)
MIN_EIGENVALUE = 0.05
QUARTERS = ("lowest", "second", "third", "highest")  # signal bands: the rest's quartiles
# a (layer, band) cell in which a witness's tokens are expected to show fewer events than this
# is left out: the normal approximation of so few is liberal in the tail that the level reaches
MIN_CELL_EVENTS = 10


@dataclass(frozen=True)
class OutlierFinding:
    """One witness's most significant difference from the rest of its fleet."""

    runtime_id: str  # the witness: a runtime id, or the credential that vouches for it
    statistic: str  # one of STATISTICS
    layer: int | None
    runtime_rate: float
    fleet_rate: float
    z: float
    p_value: float
    level: float
    tokens: int
    requests: int
    fleet_tokens: int
    fleet_requests: int
    fleet_runtimes: int
    band: int | None = None  # matched_by_signal: the quarter of the rest's signals, 0 lowest

    def summary(self) -> str:
        what = {"matched": "shadow agreement with full depth",
                "signal_above_median": "share of signals above the fleet's median",
                "policy_disagreement": "disagreement under the active set",
                "matched_by_signal": "share of shadow tokens that matched full depth with a "
                                     f"signal in the rest's {QUARTERS[self.band or 0]} quarter"
                }[self.statistic]
        tested = ("exit layers and signal quarters" if self.statistic == "matched_by_signal"
                  else "exit layers")
        at = (f" at layer {self.layer} (most off of the {tested} tested together)"
              if self.layer is not None else "")
        return (f"witness {self.runtime_id}: {what}{at} {self.runtime_rate:.1%} on "
                f"{self.tokens} shadow tokens ({self.requests} requests) vs {self.fleet_rate:.1%} "
                f"on the other {self.fleet_runtimes} witnesses' {self.fleet_tokens} (z "
                f"{self.z:+.1f}, p={self.p_value:.2g} < {self.level:.2g}); its samples are set "
                f"aside until an operator clears it")


@dataclass(frozen=True)
class OutlierScreen:
    """One screen of a fleet's witnesses: those to set aside (`findings`, most significant
    first), every witness found beyond chance (`flagged`, the same order), and why none is set
    aside when the flagged are not a clear minority (`refused`; empty when not refused)."""

    findings: list[OutlierFinding]
    refused: str = ""
    flagged: tuple[OutlierFinding, ...] = ()


def _side_totals(codes: np.ndarray, events: np.ndarray, mask: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Per request of one side: (tokens (m,), event counts (m, k))."""
    dense = np.unique(codes[mask], return_inverse=True)[1]
    tokens = np.bincount(dense).astype(float)
    counts = np.stack([np.bincount(dense, weights=column, minlength=len(tokens))
                       for column in events[mask].T], axis=1)
    return tokens, counts


def _correlation(covariance: np.ndarray) -> np.ndarray:
    scale = np.sqrt(np.clip(np.diag(covariance), 1e-300, None))
    return covariance / np.outer(scale, scale)


def _chi_square(codes: np.ndarray, events: np.ndarray, inside: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, int]:
    """`clustered_difference` with the chi-square statistic in place of its p."""
    events = np.asarray(events, dtype=float).reshape(len(codes), -1)
    k = events.shape[1]
    if k == 0:  # nothing observed to compare (every column's layer unseen by the rest)
        return np.zeros(0), np.zeros(0), np.zeros(0), 0.0, 0
    (n_in, x_in), (n_out, x_out) = (_side_totals(codes, events, mask)
                                    for mask in (inside, ~inside))
    total_in, total_out = n_in.sum(), n_out.sum()
    rate_in, rate_out = x_in.sum(axis=0) / total_in, x_out.sum(axis=0) / total_out
    pooled = (x_in.sum(axis=0) + x_out.sum(axis=0)) / (total_in + total_out)
    varies = (pooled > 0.0) & (pooled < 1.0)
    z = np.zeros(k)
    if not varies.any():
        return rate_in, rate_out, z, 0.0, 0
    # each side's request-level spread, centred at its own rates (so a difference in rate does
    # not inflate it); a witness's few requests borrow the fleet's clustering as a floor
    residual_in = x_in - n_in[:, None] * rate_in[None, :]
    residual_out = x_out - n_out[:, None] * rate_out[None, :]
    design_out = np.array([float(null_design_effect(n_out, x_out[:, j], rate_out[j])[0])
                           for j in range(k)])
    design_in = np.maximum(design_out, [float(null_design_effect(n_in, x_in[:, j],
                                                                 rate_in[j])[0])
                                        for j in range(k)])
    variance = pooled * (1.0 - pooled) * (design_in / total_in + design_out / total_out)
    z[varies] = (rate_in - rate_out)[varies] / np.sqrt(variance[varies])
    kept = z[varies]
    statistics = []
    for covariance in (residual_in.T @ residual_in / total_in ** 2
                       + residual_out.T @ residual_out / total_out ** 2,
                       residual_out.T @ residual_out):
        correlation = _correlation(covariance[np.ix_(varies, varies)])
        values, vectors = np.linalg.eigh(correlation)
        floored = np.clip(values, MIN_EIGENVALUE, None)
        statistics.append(float(((vectors.T @ kept) ** 2 / floored).sum()))
    return rate_in, rate_out, z, min(statistics), len(kept)


def clustered_difference(codes: np.ndarray, events: np.ndarray, inside: np.ndarray
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, int]:
    """Inside vs outside on k 0/1 `events` columns over tokens clustered by request `codes`:
    (rates inside (k,), rates outside (k,), z (k,), chi-square p of all k together, the
    degrees of freedom tested); docs/concepts/statistics.md, "Outlier witnesses", derives it."""
    rate_in, rate_out, z, statistic, df = _chi_square(codes, events, inside)
    p = float(chi2.sf(statistic, df=df)) if df else 1.0
    return rate_in, rate_out, z, p, df


def _normal_score(statistic: float, df: int) -> float:
    """A chi-square on `df` degrees of freedom as a normal deviate (Wilson-Hilferty): ranks
    findings whose p-values both underflow to 0."""
    spread = 2.0 / (9.0 * df)
    return ((statistic / df) ** (1.0 / 3.0) - 1.0 + spread) / np.sqrt(spread)


def _rest_quantiles(signals: np.ndarray, rest: np.ndarray, quantiles: tuple[float, ...]
                    ) -> np.ndarray:
    """Per exit layer, the rest's signal quantiles (L, q); NaN where the rest never observed
    the layer (a NaN signal: the layer was not observed)."""
    out = np.full((signals.shape[1], len(quantiles)), np.nan)
    for j in range(signals.shape[1]):
        seen = signals[rest, j]
        seen = seen[~np.isnan(seen)]
        if len(seen):
            out[j] = np.quantile(seen, quantiles)
    return out


def _matched_by_signal(signals: np.ndarray, matched: np.ndarray, rest: np.ndarray,
                       tokens: int, layers: list[int]
                       ) -> tuple[list[tuple[int, int]], np.ndarray]:
    """Columns `matched & in band b` per exit layer and quarter b of the rest's signals there:
    ((layer, band) per column, events (n, k)). An unobserved token is in no band; a layer the
    rest never observed has no columns, nor has a cell the rest's rate expects fewer than
    MIN_CELL_EVENTS events (or non-events) of in the witness's `tokens`."""
    edges = _rest_quantiles(signals, rest, (0.25, 0.5, 0.75))  # (L, 3)
    labels, columns = [], []
    for j, layer in enumerate(layers):
        if np.isnan(edges[j]).any():
            continue
        observed = ~np.isnan(signals[:, j])
        band = np.searchsorted(edges[j], np.where(observed, signals[:, j], 0.0), side="left")
        for b in range(len(QUARTERS)):
            column = matched[:, j] & observed & (band == b)
            rate = column[rest].mean()
            if min(rate, 1.0 - rate) * tokens >= MIN_CELL_EVENTS:
                labels.append((int(layer), b))
                columns.append(column)
    events = (np.stack(columns, axis=1) if columns
              else np.zeros((len(signals), 0), dtype=bool))  # (n, 4 L)
    return labels, events


def _families(signals: np.ndarray, matched: np.ndarray, disagree: np.ndarray | None,
              inside: np.ndarray, rest: np.ndarray, layers: list[int]
              ) -> list[tuple[str, list, np.ndarray]]:
    """Each family tested for `inside` against `rest`: (statistic, (layer, band) of each
    column, events)."""
    medians = _rest_quantiles(signals, rest, (0.5,))[:, 0]
    by_layer = [(int(layer), None) for layer in layers]
    above = signals > medians[None, :]  # NaN > x is False: an unobserved layer is not above
    families = [("matched", by_layer, matched),
                ("signal_above_median", by_layer, above),
                ("matched_by_signal",
                 *_matched_by_signal(signals, matched, rest, int(inside.sum()), layers))]
    if disagree is not None:
        families.insert(0, ("policy_disagreement", [(None, None)], disagree[:, None]))
    return families


def _most_significant(*, codes: np.ndarray, inside: np.ndarray, rest: np.ndarray,
                      families: list[tuple[str, list, np.ndarray]], level: float,
                      witness: dict) -> tuple[OutlierFinding, float] | None:
    """The witness's most significant family below `level` (on p-values that tie, both
    underflowing to 0, the family listed first: the plainer account), with the largest normal
    score of its families below `level` (to rank witnesses); None when no family is."""
    scope = inside | rest
    best, score = None, -np.inf
    for statistic, labels, events in families:
        rates, fleet, z, chi_square, df = _chi_square(codes[scope], events[scope],
                                                      inside[scope])
        p = float(chi2.sf(chi_square, df=df)) if df else 1.0
        if p >= level:
            continue
        score = max(score, _normal_score(chi_square, df))
        if best is None or p < best.p_value:
            j = int(np.argmax(np.abs(z)))
            layer, band = labels[j]
            best = OutlierFinding(statistic=statistic, layer=layer, band=band,
                                  runtime_rate=float(rates[j]), fleet_rate=float(fleet[j]),
                                  z=float(z[j]), p_value=p, level=level, **witness)
    return None if best is None else (best, score)


def _most_off(*, codes: np.ndarray, by_witness: np.ndarray, names: np.ndarray,
              request_counts: np.ndarray, judges: list[int], signals: np.ndarray,
              matched: np.ndarray, disagree: np.ndarray | None, layers: list[int],
              level: float) -> tuple[int, OutlierFinding] | None:
    """Of the `judges` (witness indexes), the one most significantly off the rest of them,
    with its finding; None when none is below `level`."""
    found = []
    for index in judges:
        inside = by_witness == index
        rest = ~inside & np.isin(by_witness, judges)
        witness = {"runtime_id": str(names[index]), "tokens": int(inside.sum()),
                   "requests": int(request_counts[index]), "fleet_tokens": int(rest.sum()),
                   "fleet_requests": int(request_counts[judges].sum() - request_counts[index]),
                   "fleet_runtimes": len(judges) - 1}
        best = _most_significant(codes=codes, inside=inside, rest=rest, level=level,
                                 families=_families(signals, matched, disagree, inside, rest,
                                                    layers), witness=witness)
        if best is not None:
            found.append((best[0].p_value, -best[1], index, best[0]))
    if not found:
        return None
    _, _, index, finding = min(found, key=lambda item: item[:2])
    return index, finding


def _refusal(flagged: list[OutlierFinding], tested: int) -> str:
    names = ", ".join(finding.runtime_id for finding in flagged)
    return (f"{len(flagged)} of the {tested} witnesses tested ({names}) differ from the rest "
            "beyond chance, more than a minority: the rest is no clear majority to judge them "
            "by, so none is set aside; compare the witnesses' evidence (a fleet split by "
            "traffic, model or version, or several lying witnesses) and set aside by hand "
            "those that are off")


def screen_witnesses(*, requests, runtimes, signals: np.ndarray, matched: np.ndarray,
                     thresholds: list[float] | None, layers: list[int], alpha: float,
                     min_requests: int, robust_min_runtimes: int, already_set_aside: int = 0
                     ) -> OutlierScreen:
    """Screen the witnesses (`runtimes`: one label per shadow token) at family-wise level
    `alpha`: the most significant is peeled off while any differs from the rest of those not
    yet peeled; when more than a minority of those tested would be, none is set aside
    (`refused`), else the first peeled are, at most a minority of all the deployment's
    witnesses with the `already_set_aside` ones (not in the input). `thresholds` None (evidence
    mixing versions) skips the policy family. See the module docstring."""
    if already_set_aside < 0:
        raise ValueError(f"already_set_aside must be 0 or more, not {already_set_aside}")
    witnesses = np.asarray(runtimes).astype(str)
    if len(witnesses) == 0:
        return OutlierScreen([])
    signals = np.asarray(signals, dtype=float)
    matched = np.asarray(matched, dtype=bool)
    codes = cluster_codes(np.char.add(np.char.add(witnesses, "/"),
                                      np.asarray(requests).astype(str)))
    names, by_witness = np.unique(witnesses, return_inverse=True)
    request_counts = np.array([len(np.unique(codes[by_witness == i])) for i in range(len(names))])
    tested = [int(i) for i in np.flatnonzero(request_counts >= min_requests)]
    if len(tested) < max(3, robust_min_runtimes):
        return OutlierScreen([])
    disagree = None if thresholds is None else policy_outcomes(signals, matched, thresholds)[1]
    level = alpha / (len(tested) * (len(STATISTICS) - (disagree is None)))
    minority = (len(tested) - 1) // 2
    flagged: list[OutlierFinding] = []
    judges = list(tested)
    while len(judges) >= 2 and len(flagged) <= minority:
        found = _most_off(codes=codes, by_witness=by_witness, names=names,
                          request_counts=request_counts, judges=judges, signals=signals,
                          matched=matched, disagree=disagree, layers=layers, level=level)
        if found is None:
            break
        flagged.append(found[1])
        judges.remove(found[0])
    if len(flagged) > minority:
        return OutlierScreen([], refused=_refusal(flagged, len(tested)), flagged=tuple(flagged))
    # the unflagged then hold a clear majority of those tested, so also of those left in
    # however many the total cap keeps in
    room = max(0, (len(tested) + already_set_aside - 1) // 2 - already_set_aside)
    return OutlierScreen(flagged[:room], flagged=tuple(flagged))


def runtime_outliers(*, requests, runtimes, signals: np.ndarray, matched: np.ndarray,
                     thresholds: list[float] | None, layers: list[int], alpha: float,
                     min_requests: int, robust_min_runtimes: int, already_set_aside: int = 0
                     ) -> list[OutlierFinding]:
    """The witnesses to set aside: `screen_witnesses(...).findings` (empty when it refuses)."""
    return screen_witnesses(requests=requests, runtimes=runtimes, signals=signals,
                            matched=matched, thresholds=thresholds, layers=layers, alpha=alpha,
                            min_requests=min_requests, robust_min_runtimes=robust_min_runtimes,
                            already_set_aside=already_set_aside).findings


def detect_outliers(*, session: Session, deployment: Deployment, version: int,
                    thresholds_of: dict[str, list[float]], activated_at: datetime,
                    now: datetime, options: DriftOptions, min_requests: int,
                    robust_min_runtimes: int,
                    counts: Callable[[str], bool] | None = None) -> list[RuntimeOutlier]:
    """Screen the witnesses on each segment's recent shadow tokens of `version`
    (`thresholds_of`: the thresholds each segment applies); set aside and alert on the
    outliers found. `counts`: which runtime ids' tokens are screened (None: all; a canary
    screens its members only). Returns the records newly opened."""
    since = max(now - timedelta(seconds=options.recent_s), activated_at)
    alpha = (options.quality_alpha_per_hour * options.check_interval_s / 3600.0
             / max(1, len(thresholds_of)))
    newly = []
    for segment, thresholds in thresholds_of.items():
        found = shadow_evidence(session=session, deployment=deployment, since=since,
                                version=version, segment=segment,
                                limit=options.max_shadow_tokens)
        keep = np.ones(len(found.runtimes), dtype=bool) if counts is None else np.array(
            [counts(runtime_id) for runtime_id in found.runtimes], dtype=bool)
        newly += screen_evidence(session=session, deployment=deployment,
                                 requests=found.keyed_requests()[keep],
                                 witnesses=np.asarray(found.witnesses, dtype=str)[keep],
                                 signals=found.signals[keep], matched=found.matched[keep],
                                 thresholds=thresholds, alpha=alpha, min_requests=min_requests,
                                 robust_min_runtimes=robust_min_runtimes, version=version,
                                 segment=segment, window=(since, now), now=now)
    session.flush()
    return newly


def screen_evidence(*, session: Session, deployment: Deployment, requests, witnesses,
                    signals: np.ndarray, matched: np.ndarray,
                    thresholds: list[float] | None, alpha: float, min_requests: int,
                    robust_min_runtimes: int, version: int | None, segment: str,
                    window: tuple[datetime, datetime], now: datetime,
                    context: str = "") -> list[RuntimeOutlier]:
    """Screen one segment's shadow tokens (read without the witnesses already set aside; each
    with its request id, keyed by runtime, and its witness) witness by witness
    (`screen_witnesses`), set aside and alert on the outliers, and
    alert (without setting anyone aside) when the fleet's evidence is split with no clear
    majority. `version` None: the evidence spans every version of a calibration window
    (`thresholds` None then). Returns the records newly opened."""
    already = len(excluded_witnesses(session=session, deployment_id=deployment.id))
    # Each witness is judged against the others as witnesses, not as volume: every one is
    # cut to the median witness's tokens (whole requests) first, so that a few flooding
    # witnesses cannot make the rest look like the odd ones out.
    requests, witnesses = np.asarray(requests).astype(str), np.asarray(witnesses).astype(str)
    keep = cap_runtime_share(witnesses, requests, max_share=1.0, max_share_of_median=1.0,
                             min_runtimes=robust_min_runtimes, seed=0)
    requests, witnesses = requests[keep], witnesses[keep]
    signals, matched = np.asarray(signals)[keep], np.asarray(matched)[keep]
    screen = screen_witnesses(
        requests=requests, runtimes=witnesses, signals=signals, matched=matched,
        thresholds=thresholds,
        layers=sorted(deployment.exit_layers), alpha=alpha, min_requests=min_requests,
        robust_min_runtimes=robust_min_runtimes, already_set_aside=already)
    where = ("" if segment == DEFAULT_SEGMENT else f"segment {segment}: ") + context
    scope = {"version": version, "segment": segment,
             "window": {"since": window[0].isoformat(), "until": window[1].isoformat()}}
    if screen.refused:
        fire(session=session, deployment=deployment, now=now, condition=Condition(
            kind=AlertKind.RUNTIME_OUTLIER, severity="warning", subject="fleet-split",
            segment=segment, summary=where + screen.refused,
            evidence=scope | {"flagged": [finding.__dict__ for finding in screen.flagged]}))
    newly = []
    for finding in screen.findings:
        runtime_id, named = _witness_names(session=session, deployment=deployment,
                                           witness=finding.runtime_id)
        evidence_of = finding.__dict__ | scope | {"runtime_id": runtime_id,
                                                  "witness": finding.runtime_id,
                                                  "runtimes": named}
        summary = finding.summary() + (f" (its runtimes: {', '.join(named[:10])})"
                                       if named else "")
        alert, _ = fire(session=session, deployment=deployment, now=now,
                        condition=Condition(
                            kind=AlertKind.RUNTIME_OUTLIER, severity="warning",
                            subject=finding.runtime_id, segment=segment,
                            summary=where + summary, evidence=evidence_of))
        record, created = set_aside(
            session=session, deployment=deployment, runtime_id=runtime_id,
            witness=finding.runtime_id, version=version if version is not None else 0,
            segment=segment, summary=summary, evidence=evidence_of, alert_id=alert.id, now=now)
        if created:
            alert.action_taken = (f"witness {finding.runtime_id} set aside: the shadow tokens "
                                  "it vouches for, under any runtime id, no longer feed "
                                  "calibration, drift or canary verdicts until an operator "
                                  "clears it")
            newly.append(record)
    return newly


def _witness_names(*, session: Session, deployment: Deployment, witness: str
                   ) -> tuple[str, list[str]]:
    """(the runtime id an outlier record keys `witness` by, the runtime ids registered to its
    token): a runtime-id witness is that runtime; a token's is keyed by the witness itself."""
    if witness.startswith(RUNTIME_PREFIX):
        runtime_id = witness[len(RUNTIME_PREFIX):]
        return runtime_id, [runtime_id]
    token = token_of(witness)
    named = [] if token is None else list(session.scalars(
        select(Runtime.runtime_id).where(Runtime.deployment_id == deployment.id,
                                         Runtime.token_id == token)
        .order_by(Runtime.runtime_id).limit(200)))
    return witness, named
