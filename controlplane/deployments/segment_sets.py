"""A threshold set seen per traffic segment: the map a segment applies, and the maps
of a new version in which one segment's map changes and every other segment keeps its own.

The fallback (one segment falls back) and a segment's recalibration (one segment's map is
replaced) both publish such a version; the drift detector reads the map a segment applies.
"""

from __future__ import annotations

from controlplane.deployments.models import ThresholdSet
from exitplane.wire import DEFAULT_SEGMENT


def thresholds_for(threshold_set: ThresholdSet, segment: str) -> dict[int, float]:
    """The per-layer thresholds rows of `segment` apply under `threshold_set`: its own map,
    else the set's `thresholds` (the runtime's `ThresholdSetWire.for_segment`)."""
    own = (threshold_set.segments_by_layer() or {}).get(segment)
    return own if own is not None else threshold_set.thresholds_by_layer()


def has_own_map(threshold_set: ThresholdSet, segment: str) -> bool:
    """Whether `segment` has thresholds of its own in the set ('default' always has)."""
    return segment == DEFAULT_SEGMENT or segment in (threshold_set.segments or {})


def replace_segment_map(threshold_set: ThresholdSet, segment: str, by_layer: dict[int, float]
                        ) -> tuple[dict[int, float], dict[str, dict[int, float]] | None]:
    """(thresholds, segments) of a version equal to `threshold_set` except that `segment`
    applies `by_layer`: 'default' replaces `thresholds`, any other segment gets (or replaces)
    its own map. Segments that had no map of their own keep applying `thresholds`, so
    replacing 'default' changes them too; that is what they applied before."""
    thresholds = threshold_set.thresholds_by_layer()
    segments = dict(threshold_set.segments_by_layer() or {})
    if segment == DEFAULT_SEGMENT:
        thresholds = dict(by_layer)
    else:
        segments[segment] = dict(by_layer)
    return thresholds, segments or None
