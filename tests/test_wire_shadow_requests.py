"""Shadow requests on the wire: the two record markers (left off when false, validated at
record and batch level, carried column by column in interval batches and through their
splits), the control plane's parse path agreeing with the model, the shadow-request rate in
pulls (outside the checksum, inside the ETag) and the protocol vector for a shadow request."""

import json

import msgpack
import pytest
from pydantic import ValidationError

from controlplane.telemetry.columns import _parse_columns, parse_batch
from exitplane.client.codec import encode_interval, encode_records
from exitplane.wire import (
    IntervalBatch,
    RecordColumns,
    TelemetryBatch,
    ThresholdPull,
    ThresholdSetWire,
    TokenRecord,
    pull_etag,
)
from scripts.vectors import payloads

NUM_LAYERS = 6


def _points(matched=(True, False)):
    return [{"layer": layer, "signal": 0.25 * (index + 1), "matched": hit}
            for index, (layer, hit) in enumerate(zip((2, 4), matched, strict=True))]


def _record(position, **changes):
    record = {"threshold_version": 3, "request_id": "req-7", "position": position,
              "exit_layer": NUM_LAYERS, "signal_value": 0.5, "latency_us": 1500,
              "ts": 1_764_460_800.0 + position, "shadow": _points(), "shadow_request": True}
    return {**record, **changes}


def _request(length=4):
    """A shadow request's records, the last one request_end, plus one ordinary token."""
    records = [_record(position) for position in range(length)]
    records[-1]["request_end"] = True
    ordinary = {"threshold_version": 3, "request_id": "req-8", "position": 0, "exit_layer": 2,
                "signal_value": 0.9, "latency_us": 400, "ts": 1_764_460_800.0}
    return [*records, ordinary]


def _batch(records):
    return {"batch_id": "a1b2c3d4e5f6a7b8", "deployment": "tiny", "runtime_id": "rt-1",
            "seq": 3, "num_layers": NUM_LAYERS, "records": records}


def test_the_markers_round_trip_and_are_left_off_when_false():
    batch = TelemetryBatch.model_validate(_batch(_request()))
    dumped = batch.model_dump(mode="json")
    flagged, ordinary = dumped["records"][:-1], dumped["records"][-1]
    assert all(record["shadow_request"] is True for record in flagged)
    assert [record.get("request_end", False) for record in flagged] == [False] * 3 + [True]
    assert "shadow_request" not in ordinary and "request_end" not in ordinary
    assert "request_end" not in flagged[0]
    assert TelemetryBatch.model_validate_json(batch.model_dump_json()) == batch
    assert TelemetryBatch.model_validate(msgpack.unpackb(msgpack.packb(dumped))) == batch


@pytest.mark.parametrize(("changes", "message"), [
    ({"shadow": None}, "carries the shadow points"),
    ({"shadow": []}, "carries the shadow points"),
    ({"shadow_request": 1}, "valid boolean"),
    ({"request_end": "true"}, "valid boolean"),
])
def test_a_malformed_shadow_request_token_is_refused(changes, message):
    with pytest.raises(ValidationError, match=message):
        TokenRecord.model_validate(_record(0, **changes))


def test_a_shadow_request_token_runs_at_full_depth():
    records = _request()
    records[1]["exit_layer"] = 4
    with pytest.raises(ValidationError, match="record 1: a shadow_request token runs at full "
                                              "depth, but its exit_layer is 4, not num_layers 6"):
        TelemetryBatch.model_validate(_batch(records))
    # request_end alone says nothing of depth: an early-exiting request may end too.
    plain = {**records[-1], "request_end": True}
    assert TelemetryBatch.model_validate(_batch([plain])).records[0].request_end


def test_the_control_plane_parse_path_agrees_with_the_model():
    good = _batch(_request())
    parsed = _parse_columns(good)  # the fast path takes it (raises if it would fall back)
    assert parsed.shadow_request.tolist() == [True] * 4 + [False]
    assert parsed.request_end.tolist() == [False] * 3 + [True, False]
    assert parsed.to_wire() == TelemetryBatch.model_validate(good).model_dump(mode="json")
    shallow = _batch(_request())
    shallow["records"][0]["exit_layer"] = 4
    with pytest.raises(ValidationError, match="runs at full depth"):
        parse_batch(shallow)
    unlabelled = _batch(_request())
    unlabelled["records"][2]["shadow"] = None
    with pytest.raises(ValidationError, match="carries the shadow points"):
        parse_batch(unlabelled)


def test_interval_batches_carry_the_markers_as_columns_and_through_their_splits():
    records = [TokenRecord.model_validate(record) for record in _request(6)]
    columns = RecordColumns.of(records)
    assert columns.shadow_request == [True] * 6 + [False]
    assert columns.request_end == [False] * 5 + [True, False]
    assert columns.records() == records
    plain = RecordColumns.of([records[-1]]).model_dump(mode="json")
    assert "shadow_request" not in plain and "request_end" not in plain
    encoded = encode_interval(deployment="tiny", runtime_id="rt-1", seq=1,
                              num_layers=NUM_LAYERS, raw_sample_rate=1.0, cells=[],
                              records=columns, content_type="application/vnd.exitplane."
                                                            "interval+json")
    halves = encoded.split()
    again = [record for half in halves
             for record in IntervalBatch.model_validate(half.decode()).records.records()]
    assert again == records
    (record_batch,) = encoded.unbundled()
    assert TelemetryBatch.model_validate(record_batch.decode()).records == records


def test_interval_columns_refuse_what_records_refuse():
    columns = RecordColumns.of([TokenRecord.model_validate(r) for r in _request(3)])
    body = IntervalBatch(batch_id="c0ffee00c0ffee00", deployment="tiny", runtime_id="rt-1",
                         seq=1, num_layers=NUM_LAYERS, raw_sample_rate=1.0,
                         records=columns).model_dump(mode="json")
    shallow = json.loads(json.dumps(body))
    shallow["records"]["exit_layer"][1] = 4
    with pytest.raises(ValidationError, match="record 1: a shadow_request token runs at full"):
        IntervalBatch.model_validate(shallow)
    unlabelled = json.loads(json.dumps(body))
    owner = unlabelled["records"]["shadow_record"]
    keep = [index for index, record in enumerate(owner) if record != 0]
    for name in ("shadow_record", "shadow_layer", "shadow_signal", "shadow_matched"):
        unlabelled["records"][name] = [unlabelled["records"][name][i] for i in keep]
    with pytest.raises(ValidationError, match="record 0: a shadow_request token carries"):
        IntervalBatch.model_validate(unlabelled)
    short = json.loads(json.dumps(body))
    short["records"]["request_end"] = short["records"]["request_end"][1:]
    with pytest.raises(ValidationError,
                       match="column request_end has 3 entries, threshold_version 4"):
        IntervalBatch.model_validate(short)


def test_a_record_batch_encodes_the_markers_for_shipping():
    encoded = encode_records(deployment="tiny", runtime_id="rt-1", seq=2,
                             num_layers=NUM_LAYERS, records=_request(), aggregated=True)
    decoded = TelemetryBatch.model_validate(encoded.decode())
    assert [record.shadow_request for record in decoded.records] == [True] * 4 + [False]


def test_the_shadow_request_rate_is_outside_the_checksum_and_inside_the_etag():
    wire = ThresholdSetWire.build(deployment="tiny", version=3, signal="maxprob",
                                  thresholds={2: 0.9, 4: 0.75})
    pulled = ThresholdPull(**wire.model_dump(), shadow_rate=0.05, shadow_request_rate=0.01)
    body = json.loads(pulled.model_dump_json())
    assert body["shadow_request_rate"] == 0.01
    assert pulled.threshold_set() == wire  # neither rate is part of the set
    pulled.threshold_set().verify()
    assert "shadow_request_rate" not in ThresholdPull(**wire.model_dump()).model_dump(mode="json")
    checksum = wire.checksum
    assert pull_etag(checksum, None) == pull_etag(checksum, None, None) == checksum
    assert pull_etag(checksum, 0.05) == f"{checksum}.s0.05"  # unchanged without the new rate
    assert pull_etag(checksum, 0.05, 0.01) == f"{checksum}.s0.05.r0.01"
    assert pull_etag(checksum, None, 0.01) == f"{checksum}.r0.01"
    assert pull_etag(checksum, 0.05, 0.02) != pull_etag(checksum, 0.05, 0.01)
    with pytest.raises(ValidationError):
        ThresholdPull(**wire.model_dump(), shadow_request_rate=1.5)


def test_the_protocol_vector_of_a_shadow_request():
    vectors = payloads()
    vector = vectors["shadow_request_batch"]
    batch = TelemetryBatch.model_validate(vector["payload"])
    assert batch.model_dump(mode="json") == vector["payload"]
    assert msgpack.unpackb(bytes.fromhex(vector["msgpack_hex"])) == vector["payload"]
    assert [record.position for record in batch.records] == list(range(len(batch.records)))
    assert all(record.shadow_request and record.exit_layer == batch.num_layers
               and {point.layer for point in record.shadow} == {2, 4}
               for record in batch.records)
    assert [record.request_end for record in batch.records][-2:] == [False, True]
    pull = vectors["threshold_pull_with_rates"]
    pulled = ThresholdPull.model_validate(pull["payload"])
    assert pull["etag"] == f'"{pull_etag(pulled.checksum, 0.05, 0.01)}"'
    refusals = [case for case in vectors["refused"] if "shadow-request" in case["note"]]
    assert len(refusals) == 2
    for case in refusals:
        with pytest.raises(ValidationError, match=case["detail_contains"]):
            TelemetryBatch.model_validate(case["payload"])
