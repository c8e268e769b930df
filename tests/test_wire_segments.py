"""Per-segment thresholds on the wire: one set, one checksum that covers the segment
map, a set without segments unchanged byte for byte, and the lookup that falls back to default."""

import hashlib
import json

import pytest
from pydantic import ValidationError

from exitplane.wire import ThresholdSetWire, canonical_json, threshold_checksum

LAYERS = {2: 0.9, 4: 0.75}
SEGMENTS = {"code": {2: 1.0, 4: 0.95}, "chat": {2: 0.8, 4: 0.7}}


def _build(segments=None, **changes) -> ThresholdSetWire:
    return ThresholdSetWire.build(deployment="tiny", version=3, signal="maxprob",
                                  thresholds=changes.get("thresholds", LAYERS), segments=segments)


def test_a_set_without_segments_serialises_and_checksums_as_before():
    wire = _build()
    body = json.loads(wire.model_dump_json())
    assert "segments" not in body  # absent, not null: old runtimes see the same document
    assert set(body) == {"deployment", "version", "signal", "thresholds", "checksum"}
    before = canonical_json({"deployment": "tiny", "version": 3, "signal": "maxprob",
                             "thresholds": {"2": 0.9, "4": 0.75}})
    assert wire.checksum == hashlib.sha256(before).hexdigest()
    assert _build(segments={}).checksum == wire.checksum
    assert ThresholdSetWire.model_validate({**body, "segments": {}}).segments is None


def test_the_checksum_covers_every_segment_value():
    plain, segmented = _build(), _build(SEGMENTS)
    assert segmented.checksum != plain.checksum
    segmented.verify()
    tampered = segmented.model_dump(mode="json")
    tampered["segments"]["code"]["4"] = 0.5
    with pytest.raises(ValueError, match="checksum mismatch"):
        ThresholdSetWire.model_validate(tampered).verify()
    dropped = segmented.model_dump(mode="json")
    del dropped["segments"]["chat"]
    with pytest.raises(ValueError, match="checksum mismatch"):
        ThresholdSetWire.model_validate(dropped).verify()
    # Order of segments or layers does not matter: the canonical JSON sorts them.
    reordered = {"chat": {4: 0.7, 2: 0.8}, "code": {4: 0.95, 2: 1.0}}
    assert _build(reordered).checksum == segmented.checksum


def test_the_canonical_json_places_segments_as_the_protocol_says():
    expected = ('{"deployment":"tiny","segments":{"chat":{"2":0.8,"4":0.7},"code":{"2":1.0,'
                '"4":0.95}},"signal":"maxprob","thresholds":{"2":0.9,"4":0.75},"version":3}')
    assert threshold_checksum(deployment="tiny", version=3, signal="maxprob", thresholds=LAYERS,
                              segments=SEGMENTS) == hashlib.sha256(expected.encode()).hexdigest()


def test_a_segmented_set_round_trips_through_json():
    wire = _build(SEGMENTS)
    again = ThresholdSetWire.model_validate_json(wire.model_dump_json())
    assert again == wire and again.segments == {"code": {2: 1.0, 4: 0.95},
                                                 "chat": {2: 0.8, 4: 0.7}}
    again.verify()


@pytest.mark.parametrize(("segments", "message"), [
    ({"default": {2: 0.5, 4: 0.5}}, "set's own `thresholds`"),
    ({"Code": {2: 0.5, 4: 0.5}}, "segments.Code"),
    ({"code": {2: 1.5, 4: 0.5}}, "less than or equal to 1"),
])
def test_malformed_segment_maps_are_refused(segments, message):
    body = {**_build().model_dump(mode="json"), "segments": segments}
    with pytest.raises(ValidationError, match=message):
        ThresholdSetWire.model_validate(body)


def test_lookup_by_segment_falls_back_to_default():
    wire = _build(SEGMENTS)
    assert wire.for_segment("code") == {2: 1.0, 4: 0.95}
    assert wire.for_segment("chat") == {2: 0.8, 4: 0.7}
    for unknown in ("retrieval", "default", "", None):
        assert wire.for_segment(unknown) == LAYERS
    assert _build().for_segment("code") == LAYERS
