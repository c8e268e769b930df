"""Traffic segments in the admin UI: a version's segment maps as a layer x segment
table, their per-segment diff, the new-version form's segment rows, the deployment page's
per-segment traffic table, and the segments page's registry rows.

Plain functions over `ThresholdSet`; names, the cap and the per-layer ranges are checked by the
thresholds service, so the form shows the same messages as the API.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.datastructures import FormData

from controlplane.deployments.models import Deployment, ThresholdSet
from controlplane.deployments.segments import segment_registry
from controlplane.errors import Invalid
from exitplane.wire import DEFAULT_SEGMENT

# Row indices are bounded so a crafted form cannot make the parser walk huge numbers.
SEGMENT_ROW = re.compile(r"^segment_(\d{1,3})_name$")


def segment_maps(threshold_set: ThresholdSet) -> list[tuple[str, dict[int, float]]]:
    """`default` first, then each segment by name: the columns of a version's layer table."""
    segments = threshold_set.segments_by_layer() or {}
    return [(DEFAULT_SEGMENT, threshold_set.thresholds_by_layer()),
            *sorted(segments.items())]


@dataclass(frozen=True)
class SegmentDiff:
    """One segment across two versions. A version without the segment applies its default
    map to that segment's rows, so `layers` holds what each version actually applies and
    `own_a` / `own_b` say whether that is the segment's own map."""

    name: str
    own_a: bool
    own_b: bool
    layers: list[tuple[int, float | None, float | None]]

    @property
    def status(self) -> str:
        if self.own_a and not self.own_b:
            return "removed"
        if self.own_b and not self.own_a:
            return "added"
        return "changed" if any(a != b for _, a, b in self.layers) else "same"


def diff_segments(a: ThresholdSet, b: ThresholdSet,
                  exit_layers: list[int]) -> list[SegmentDiff]:
    """Per-segment changes between `a` and `b` (empty when neither names a segment)."""
    segs_a, segs_b = a.segments_by_layer() or {}, b.segments_by_layer() or {}
    default_a, default_b = a.thresholds_by_layer(), b.thresholds_by_layer()
    diffs = []
    for name in sorted(set(segs_a) | set(segs_b)):
        map_a, map_b = segs_a.get(name, default_a), segs_b.get(name, default_b)
        layers = [(layer, map_a.get(layer), map_b.get(layer))
                  for layer in sorted(set(map_a) | set(map_b) | set(exit_layers))]
        diffs.append(SegmentDiff(name=name, own_a=name in segs_a, own_b=name in segs_b,
                                 layers=layers))
    return diffs


@dataclass
class SegmentRow:
    """One segment row of the new-version form, as typed (kept to re-show a refused form)."""

    name: str
    values: dict[int, str]


def rows_from_form(form: FormData, exit_layers: list[int]) -> list[SegmentRow]:
    """The form's segment rows in index order, blank ones included."""
    indices = sorted({int(match.group(1)) for key in form
                      if (match := SEGMENT_ROW.match(key))})
    return [SegmentRow(name=str(form.get(f"segment_{i}_name", "")).strip(),
                       values={layer: str(form.get(f"segment_{i}_layer_{layer}", "")).strip()
                               for layer in exit_layers})
            for i in indices]


def rows_for(threshold_set: ThresholdSet, exit_layers: list[int],
             blank: int) -> list[SegmentRow]:
    """The rows a new version starts from: `threshold_set`'s segments, then `blank` unnamed
    rows holding a copy of its default map (name one to give a segment those values)."""
    default = threshold_set.thresholds_by_layer()
    rows = [SegmentRow(name=name, values={layer: _typed(by_layer.get(layer))
                                          for layer in exit_layers})
            for name, by_layer in sorted((threshold_set.segments_by_layer() or {}).items())]
    rows += [SegmentRow(name="", values={layer: _typed(default.get(layer))
                                         for layer in exit_layers}) for _ in range(blank)]
    return rows


def segments_from_rows(rows: list[SegmentRow]) -> dict[str, dict[int, float]] | None:
    """The `segments` map to publish; an unnamed row is skipped (blank, or a segment the
    operator dropped by clearing its name). Invalid names a duplicate or a non-number."""
    segments: dict[str, dict[int, float]] = {}
    for row in rows:
        if not row.name:
            continue
        if row.name in segments:
            raise Invalid(f"segment {row.name!r} is named twice; give each segment one row")
        by_layer = {}
        for layer, raw in row.values.items():
            try:
                by_layer[layer] = float(raw)
            except ValueError:
                raise Invalid(f"segment {row.name!r}: threshold for layer {layer} must be a "
                              f"number in [0, 1], got {raw!r}") from None
        segments[row.name] = by_layer
    return segments or None


def _typed(value: float | None) -> str:
    return "" if value is None else str(value)


@dataclass(frozen=True)
class SegmentTraffic:
    """One row of the deployment page's segment table: the window's figures and the
    thresholds the active version applies to the segment's rows."""

    name: str
    tokens: int
    exit_rate: float | None
    shadow_tokens: int
    disagreement: float | None
    thresholds: dict[int, float]
    own_map: bool  # False: the version has no map for it and applies its default one


def segment_table(totals: list[dict], active: ThresholdSet) -> list[SegmentTraffic]:
    """`totals` (charts.segment_totals, default first) joined with `active`'s maps."""
    own = active.segments_by_layer() or {}
    default = active.thresholds_by_layer()
    return [SegmentTraffic(name=row["segment"], tokens=row["tokens"],
                           exit_rate=row["exit_rate"], shadow_tokens=row["shadow_tokens"],
                           disagreement=row["disagreement"],
                           thresholds=own.get(row["segment"], default),
                           own_map=row["segment"] == DEFAULT_SEGMENT or row["segment"] in own)
            for row in totals]


# What a calibration job's per-segment result may call its outcome: seg-loop's job result uses
# "outcome"; `SegmentedCalibration.summary()` says "source" ("segment" for its own LTT set).
OUTCOMES = {"segment": "calibrated", "calibrated": "calibrated", "pooled": "pooled",
            "conservative": "conservative"}


def segment_outcome(result: dict) -> str:
    """'calibrated', 'pooled' or 'conservative' for one segment of a job's result."""
    raw = result.get("outcome", result.get("source"))
    return OUTCOMES.get(raw, str(raw or "unknown"))


# Where a segment in use came from, as the segments page says it.
ORIGINS = {"operator": "declared by an operator", "threshold_set": "mapped by a published set",
           "telemetry": "registered from runtime telemetry"}


@dataclass(frozen=True)
class RegistryRow:
    """One segment of the segments page: in use or removed, and what holds it."""

    name: str
    origin: str
    since: datetime  # declared (in use) or removed
    in_use: bool
    mapped_by: list[str]  # aliases whose set has a map of its own for it ('active (v3)')

    @property
    def origin_text(self) -> str:
        return ORIGINS.get(self.origin, self.origin)


def registry_rows(*, session: Session, deployment: Deployment,
                  aliases: dict[str, int]) -> list[RegistryRow]:
    """The deployment's segments, in use first, each with the aliased sets that map it."""
    maps = dict(session.execute(select(ThresholdSet.version, ThresholdSet.segments).where(
        ThresholdSet.deployment_id == deployment.id,
        ThresholdSet.version.in_(set(aliases.values())))).all())
    rows = [RegistryRow(name=row.name, origin=row.origin,
                        since=row.removed_at or row.created_at, in_use=row.removed_at is None,
                        mapped_by=[f"{alias} (v{version})"
                                   for alias, version in sorted(aliases.items())
                                   if row.name in (maps.get(version) or {})])
            for row in segment_registry(session=session, deployment_id=deployment.id)]
    return sorted(rows, key=lambda row: (not row.in_use, row.name))
