"""Telemetry reads per traffic segment: what each segment's tokens did in a window.

Everything comes from the per-minute rollups, which count every token whether runtimes ship
records or aggregates. The segments read are the deployment's registered ones plus `default`
(`controlplane.deployments.segments`), so the number of rows a read returns is bounded by the
registry's cap however many names traffic carried.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controlplane.deployments.models import Deployment
from controlplane.deployments.segments import known_segments, readable_segments
from controlplane.errors import NotFound
from controlplane.telemetry.models import Rollup, TelemetryBatchRow
from controlplane.telemetry.tables import ROLLUP_COUNTERS
from exitplane.wire import DEFAULT_SEGMENT


def segment_names(*, session: Session, deployment: Deployment) -> list[str]:
    """`default` first, then the deployment's registered segments by name."""
    return [DEFAULT_SEGMENT, *known_segments(session=session, deployment_id=deployment.id)]


def check_segment(*, session: Session, deployment: Deployment, segment: str | None) -> None:
    """NotFound unless `segment` is None (every segment), `default` or a registered name (in
    use or removed: a removed segment's stored traffic stays readable)."""
    if segment is None or segment == DEFAULT_SEGMENT:
        return
    if segment not in readable_segments(session=session, deployment_id=deployment.id):
        names = segment_names(session=session, deployment=deployment)
        raise NotFound(f"deployment {deployment.name!r} knows no segment {segment!r}; its "
                       f"segments are {', '.join(names)}")


@dataclass
class RollupFigures:
    """Counts summed from rollup rows (a window, a minute, a segment's share of either) and
    the rates they give: the one definition the read API, the admin UI's totals and its
    per-minute charts derive their exit rate, depth and disagreement from."""

    tokens: int = 0  # every token is checked at the first exit layer
    early_exits: int = 0  # tokens that left before full depth
    depth_sum: int = 0  # layers run, summed over tokens
    shadow_tokens: int = 0
    policy_exits: int = 0  # shadow tokens the applied policy would have let out early
    policy_mismatches: int = 0  # of those, the ones that differ from full depth
    layers: dict[int, dict[str, int]] = field(default_factory=dict)  # exit layer -> counters

    @property
    def exit_rate(self) -> float | None:
        return self.early_exits / self.tokens if self.tokens else None

    @property
    def mean_depth(self) -> float | None:
        return self.depth_sum / self.tokens if self.tokens else None

    @property
    def disagreement(self) -> float | None:
        """Shadow tokens the policy would have answered differently from full depth, as a
        share of all shadow tokens: the quantity δ bounds (a token kept to full depth agrees)."""
        return self.policy_mismatches / self.shadow_tokens if self.shadow_tokens else None

    @property
    def exit_disagreement(self) -> float | None:
        """Of the shadow tokens the policy would have let out early, the share that differ."""
        return self.policy_mismatches / self.policy_exits if self.policy_exits else None

    def add(self, *, layer: int, counts: dict[str, int], first: int, num_layers: int) -> None:
        """Fold one (layer, counters) rollup sum in."""
        if layer == first:
            self.tokens += counts["tokens"]
            self.shadow_tokens += counts["shadow_total"]  # one label per token at each layer
        if layer < num_layers:
            self.early_exits += counts["exits"]
            self._add_layer(layer, counts)
        self.depth_sum += counts["exits"] * layer
        self.policy_exits += counts["policy_exits"]
        self.policy_mismatches += counts["policy_mismatches"]

    def _add_layer(self, layer: int, counts: dict[str, int]) -> None:
        mine = self.layers.setdefault(layer, {})
        for name, value in counts.items():
            mine[name] = mine.get(name, 0) + value

    @classmethod
    def total(cls, parts: Iterable[RollupFigures]) -> RollupFigures:
        """The sum of `parts` (minutes of a window, say), its rates derived from the sums."""
        whole = cls()
        for part in parts:
            whole.tokens += part.tokens
            whole.early_exits += part.early_exits
            whole.depth_sum += part.depth_sum
            whole.shadow_tokens += part.shadow_tokens
            whole.policy_exits += part.policy_exits
            whole.policy_mismatches += part.policy_mismatches
            for layer, counts in part.layers.items():
                whole._add_layer(layer, counts)
        return whole


@dataclass
class SegmentFigures(RollupFigures):
    """One segment's counts over a window (sums of its rollup rows)."""

    segment: str = field(kw_only=True)

    def as_dict(self) -> dict:
        return {"segment": self.segment, "tokens": self.tokens, "early_exits": self.early_exits,
                "exit_rate": self.exit_rate, "mean_depth": self.mean_depth,
                "shadow_tokens": self.shadow_tokens, "policy_exits": self.policy_exits,
                "policy_mismatches": self.policy_mismatches, "disagreement": self.disagreement,
                "exit_disagreement": self.exit_disagreement,
                "layers": [{"layer": layer, "tokens": c["tokens"], "exits": c["exits"],
                            "exit_rate": c["exits"] / c["tokens"] if c["tokens"] else None}
                           for layer, c in sorted(self.layers.items())]}


def _rollup_sums(*, session: Session, deployment: Deployment, names: list[str],
                 since: datetime, until: datetime | None, version: int | None,
                 runtime_id: str | None, by_minute: bool):
    keys = [Rollup.minute] if by_minute else []
    query = (select(*keys, Rollup.segment, Rollup.layer,
                    *[func.sum(getattr(Rollup, c)).label(c) for c in ROLLUP_COUNTERS])
             .where(Rollup.deployment_id == deployment.id, Rollup.minute >= since,
                    Rollup.segment.in_(names))
             .group_by(*keys, Rollup.segment, Rollup.layer))
    if until is not None:
        query = query.where(Rollup.minute < until)
    if version is not None:
        query = query.where(Rollup.version == version)
    if runtime_id is not None:
        query = query.where(Rollup.runtime_id == runtime_id)
    return session.execute(query)


def segment_summary(*, session: Session, deployment: Deployment, since: datetime,
                    until: datetime | None = None, version: int | None = None,
                    runtime_id: str | None = None) -> list[SegmentFigures]:
    """Per segment (`default` first, then the registered ones, also those without traffic in
    the window): tokens, exit rate, mean depth, shadow tokens and disagreement. Rollup rows of
    names the registry does not hold are left out: the answer stays bounded by the cap."""
    names = segment_names(session=session, deployment=deployment)
    figures = {name: SegmentFigures(segment=name) for name in names}
    first = deployment.exit_layers[0]
    for row in _rollup_sums(session=session, deployment=deployment, names=names, since=since,
                            until=until, version=version, runtime_id=runtime_id,
                            by_minute=False):
        figures[row.segment].add(layer=row.layer, first=first, num_layers=deployment.num_layers,
                                 counts={c: int(getattr(row, c) or 0) for c in ROLLUP_COUNTERS})
    return [figures[name] for name in names]


def segment_minutes(*, session: Session, deployment: Deployment, since: datetime,
                    until: datetime | None = None
                    ) -> dict[str, list[tuple[datetime, SegmentFigures]]]:
    """Per segment (as `segment_summary`), its minutes with telemetry, oldest first."""
    names = segment_names(session=session, deployment=deployment)
    minutes: dict[str, dict[datetime, SegmentFigures]] = {name: {} for name in names}
    first = deployment.exit_layers[0]
    for row in _rollup_sums(session=session, deployment=deployment, names=names, since=since,
                            until=until, version=None, runtime_id=None, by_minute=True):
        figures = minutes[row.segment].setdefault(row.minute,
                                                  SegmentFigures(segment=row.segment))
        figures.add(layer=row.layer, first=first, num_layers=deployment.num_layers,
                    counts={c: int(getattr(row, c) or 0) for c in ROLLUP_COUNTERS})
    return {name: sorted(by_minute.items()) for name, by_minute in minutes.items()}


def records_sampled(*, session: Session, deployment: Deployment) -> bool:
    """Whether runtimes ever aggregated at the edge for this deployment: per-token records then
    exist only for shadow tokens and a sampled share of the others (the rollups are exact)."""
    found = session.scalar(
        select(TelemetryBatchRow.batch_id)
        .where(TelemetryBatchRow.deployment_id == deployment.id,
               TelemetryBatchRow.kind.in_(("aggregate", "sampled"))).limit(1))
    return found is not None

