"""docs/vectors/ (what a runtime in another language checks itself against) agree with the
code: checksums and canonical JSON, payloads in JSON and msgpack, the aggregate batch that a
record batch's tokens make (client side and in the control plane's rollups), and refusals."""

import json
import re
from pathlib import Path

import msgpack
import numpy as np
import pytest

from controlplane.errors import Invalid
from controlplane.telemetry.api import batch_model, decode_aggregate, decode_batch
from controlplane.telemetry.columns import BatchColumns, parse_batch
from controlplane.telemetry.tables import aggregate_tables, tables_of
from exitplane.client.aggregate import Aggregator
from exitplane.wire import (
    AggregateBatch,
    AggregateCell,
    Heartbeat,
    IntervalBatch,
    RecordColumns,
    ShadowPoint,
    TelemetryBatch,
    ThresholdSetWire,
    TokenRecord,
    canonical_json,
    threshold_checksum,
)

VECTORS = Path(__file__).resolve().parents[1] / "docs" / "vectors"
CHECKSUMS = json.loads((VECTORS / "checksums.json").read_text())
PAYLOADS = json.loads((VECTORS / "payloads.json").read_text())


@pytest.mark.parametrize("case", CHECKSUMS, ids=[case["note"] for case in CHECKSUMS])
def test_checksum_vectors(case):
    thresholds = {int(layer): value for layer, value in case["thresholds"].items()}
    segments = {name: {int(layer): value for layer, value in by_layer.items()}
                for name, by_layer in case.get("segments", {}).items()} or None
    body = {"deployment": case["deployment"], "version": case["version"],
            "signal": case["signal"],
            "thresholds": {str(k): float(v) for k, v in sorted(thresholds.items())}}
    if segments:
        body["segments"] = {name: {str(k): float(v) for k, v in sorted(m.items())}
                            for name, m in segments.items()}
    head_digest = case.get("head_digest")
    if head_digest:
        body["head_digest"] = head_digest
    assert canonical_json(body).decode() == case["canonical_json"]
    assert threshold_checksum(deployment=case["deployment"], version=case["version"],
                              signal=case["signal"], thresholds=thresholds,
                              segments=segments, head_digest=head_digest) == case["checksum"]
    wire = ThresholdSetWire.build(deployment=case["deployment"], version=case["version"],
                                  signal=case["signal"], thresholds=thresholds, segments=segments,
                                  head_digest=head_digest)
    assert wire.checksum == case["checksum"]
    assert ThresholdSetWire.model_validate({**wire.model_dump(mode="json")}).checksum == \
        case["checksum"]


def test_the_checksum_vectors_include_a_segmented_set():
    assert [case["note"] for case in CHECKSUMS if case.get("segments")] == [
        "segments: sorted names and layers; 'default' is `thresholds`"]


def test_record_batch_vector():
    vector = PAYLOADS["record_batch"]
    assert msgpack.unpackb(bytes.fromhex(vector["msgpack_hex"]), raw=False) == vector["payload"]
    assert TelemetryBatch.model_validate(vector["payload"]).model_dump(mode="json") == \
        vector["payload"]
    assert parse_batch(vector["payload"]).to_wire() == vector["payload"]


def test_aggregate_vector_is_what_the_records_make():
    records, vector = PAYLOADS["record_batch"]["payload"], PAYLOADS["aggregate_batch"]
    payload = vector["payload"]
    assert msgpack.unpackb(bytes.fromhex(vector["msgpack_hex"]), raw=False) == payload
    aggregate = AggregateBatch.model_validate(payload)
    aggregator = Aggregator(exit_layers=[2, 4], num_layers=records["num_layers"])
    for record in records["records"]:
        assert aggregator.add(TokenRecord.model_validate(record))
    assert [cell.model_dump() for cell in aggregator.cut()] == payload["cells"]
    assert aggregate.tokens == len(records["records"])

    # The control plane adds the same token counts for the aggregate as for the records.
    batch = parse_batch(records)
    from_records = tables_of(deployment_id=1, exit_layers=[2, 4], num_layers=6,
                             batches=[batch], thresholds={0: np.ones(2), 3: np.ones(2)})
    rollups, histogram = aggregate_tables(deployment_id=1, exit_layers=[2, 4], num_layers=6,
                                          aggregates=[aggregate])

    def rows(table, names):
        return sorted(zip(*(np.asarray(table[name]).tolist() for name in names), strict=True))

    names = ("version", "minute", "layer", "tokens", "exits")
    assert rows(rollups, names) == [row for row in rows(from_records.rollups, names) if row[3]]
    names = ("version", "minute", "layer", "bin", "count")
    assert rows(histogram, names) == rows(from_records.histogram, names)


def test_the_checksum_vectors_include_a_set_made_for_named_heads():
    [case] = [case for case in CHECKSUMS if case.get("head_digest")]
    assert f'"head_digest":"{case["head_digest"]}"' in case["canonical_json"]


def test_threshold_set_and_heartbeat_vectors():
    vector = PAYLOADS["threshold_set"]
    wire = ThresholdSetWire.model_validate(vector["payload"])
    wire.verify()
    assert vector["etag"] == f'"{wire.checksum}"'
    assert wire.head_digest is None and "head_digest" not in vector["payload"]
    beat = Heartbeat.model_validate(PAYLOADS["heartbeat"]["payload"])
    assert beat.model_dump(mode="json") == PAYLOADS["heartbeat"]["payload"]
    assert beat.head_digest and beat.model_revision


def test_a_set_for_named_heads_fits_only_those_heads():
    vector = PAYLOADS["threshold_set_for_heads"]
    wire = ThresholdSetWire.model_validate(vector["payload"])
    wire.verify()
    assert vector["etag"] == f'"{wire.checksum}"'
    heads = PAYLOADS["heartbeat"]["payload"]["head_digest"]
    assert wire.head_digest == heads
    assert wire.fits_heads(heads) and wire.fits_heads(None) and not wire.fits_heads("0" * 64)
    # The digest is covered by the checksum: a set re-labelled for other heads fails it.
    relabelled = ThresholdSetWire.model_validate({**vector["payload"], "head_digest": "0" * 64})
    with pytest.raises(ValueError, match="checksum mismatch"):
        relabelled.verify()


@pytest.mark.parametrize("case", PAYLOADS["refused"],
                         ids=[case["note"] for case in PAYLOADS["refused"]])
def test_refused_vectors(case):
    model = batch_model(case["content_type"])
    with pytest.raises(Invalid) as refused:
        body = json.dumps(case["payload"]).encode()
        if model is None:
            decode_batch(body, case["content_type"])
        else:
            decode_aggregate(body, case["content_type"], model)
    assert refused.value.status_code == case["status"]
    assert case["detail_contains"] in str(refused.value)


def test_segmented_vectors_carry_segments_and_add_up_per_segment():
    records = PAYLOADS["segmented_record_batch"]["payload"]
    vector = PAYLOADS["segmented_aggregate_batch"]
    assert msgpack.unpackb(bytes.fromhex(PAYLOADS["segmented_record_batch"]["msgpack_hex"]),
                           raw=False) == records
    # `default` is left off the wire; the other segments travel on each record and cell.
    assert [record.get("segment") for record in records["records"][:3]] == [None, "chat", "code"]
    assert TelemetryBatch.model_validate(records).model_dump(mode="json") == records
    assert parse_batch(records).to_wire() == records
    payload = vector["payload"]
    assert msgpack.unpackb(bytes.fromhex(vector["msgpack_hex"]), raw=False) == payload
    assert {cell.get("segment", "default") for cell in payload["cells"]} == {
        "default", "chat", "code"}
    aggregator = Aggregator(exit_layers=[2, 4], num_layers=6)
    for record in records["records"]:
        assert aggregator.add(TokenRecord.model_validate(record))
    assert [cell.model_dump(mode="json") for cell in aggregator.cut()] == payload["cells"]

    # The control plane adds the same per-segment counts for the aggregate as for the records.
    from_records = tables_of(deployment_id=1, exit_layers=[2, 4], num_layers=6,
                             batches=[parse_batch(records)],
                             thresholds={0: np.ones(2), 3: np.ones(2)})
    rollups, histogram = aggregate_tables(deployment_id=1, exit_layers=[2, 4], num_layers=6,
                                          aggregates=[AggregateBatch.model_validate(payload)])

    def rows(table, names):
        return sorted(zip(*(np.asarray(table[name]).tolist() for name in names), strict=True))

    names = ("version", "minute", "segment", "layer", "tokens", "exits")
    assert rows(rollups, names) == [row for row in rows(from_records.rollups, names) if row[4]]
    assert {row[2] for row in rows(rollups, names)} == {"default", "chat", "code"}
    names = ("version", "minute", "segment", "layer", "bin", "count")
    assert rows(histogram, names) == rows(from_records.histogram, names)


def test_interval_vector_carries_the_counts_and_the_records_as_columns():
    records = PAYLOADS["segmented_record_batch"]["payload"]["records"]
    cells = PAYLOADS["segmented_aggregate_batch"]["payload"]["cells"]
    vector = PAYLOADS["interval_batch"]
    payload = vector["payload"]
    assert msgpack.unpackb(bytes.fromhex(vector["msgpack_hex"]), raw=False) == payload
    assert batch_model(vector["content_type"]) is IntervalBatch
    assert batch_model(vector["msgpack_content_type"]) is IntervalBatch
    batch = decode_aggregate(json.dumps(payload).encode(), vector["content_type"],
                             IntervalBatch)
    assert payload["cells"] == cells and batch.tokens == len(records)
    carried = [TokenRecord.model_validate(record) for index, record in enumerate(records)
               if record["shadow"] or index % 3 == 0]
    assert batch.records.records() == carried
    assert RecordColumns.of(carried).model_dump(mode="json") == payload["records"]
    columns = payload["records"]
    # present, since not every record is `default`: each record's name, `default` included
    assert columns["segment"] == [r.get("segment", "default") for index, r in enumerate(records)
                                  if r["shadow"] or index % 3 == 0]
    assert len(set(columns["segment"])) > 1
    assert len(columns["shadow_record"]) == 2 * sum(r.shadow is not None for r in carried)

    # Stored as the aggregated record batch it stands for: rows, shadow labels, no counts.
    stored = BatchColumns.of_interval(batch)
    as_records = parse_batch({**PAYLOADS["segmented_record_batch"]["payload"],
                              "batch_id": payload["batch_id"], "seq": payload["seq"],
                              "records": [r.model_dump(mode="json") for r in carried],
                              "aggregated": True})
    for name in ("threshold_version", "position", "exit_layer", "signal_value", "latency_us",
                 "ts", "shadowed", "shadow_owner", "shadow_layer", "shadow_signal",
                 "shadow_matched"):
        assert np.array_equal(getattr(stored, name), getattr(as_records, name),
                              equal_nan=True), name
    assert stored.request_id == as_records.request_id and stored.segment == as_records.segment
    assert stored.aggregated and stored.batch_id == payload["batch_id"]


def test_batches_carry_the_heartbeats_lineage_through_every_path():
    lineage = {name: PAYLOADS["heartbeat"]["payload"][name]
               for name in ("model_revision", "head_digest")}
    records = {**PAYLOADS["record_batch"]["payload"], **lineage}
    assert TelemetryBatch.model_validate(records).model_dump(mode="json") == records
    assert parse_batch(records).to_wire() == records  # the control plane's column path
    interval = {**PAYLOADS["interval_batch"]["payload"], **lineage}
    batch = decode_aggregate(json.dumps(interval).encode(),
                             PAYLOADS["interval_batch"]["content_type"], IntervalBatch)
    assert (batch.model_revision, batch.head_digest) == tuple(lineage.values())
    carried = BatchColumns.of_interval(batch)
    assert (carried.model_revision, carried.head_digest) == tuple(lineage.values())


# -- the protocol's field names against the vectors --------------------------------------------

PROTOCOL = (Path(__file__).resolve().parents[1] / "docs" / "protocol.md").read_text()


def _section(title: str) -> str:
    """The text of docs/protocol.md under the heading `title`, up to the next heading."""
    start = PROTOCOL.index(title)
    end = PROTOCOL.find("\n#", start + len(title))
    return PROTOCOL[start:end if end > 0 else None]


def _braced(text: str, opening: str) -> set[str]:
    """The quoted names in the first {...} of `text` that starts with `opening`."""
    start = text.index("{", text.index(opening))
    body, depth = [], 0
    for char in text[start:]:
        depth += {"{": 1, "}": -1}.get(char, 0)
        body.append(char)
        if depth == 0:
            break
    return set(re.findall(r'"([a-z_]+)"', "".join(body)))


def _ticked(text: str) -> set[str]:
    return set(re.findall(r"`([a-z_]+)`", text))


MESSAGES = [  # (wire model, vector payloads, the fields the protocol writes out for it)
    (TelemetryBatch, ["record_batch", "segmented_record_batch", "timed_record_batch"],
     _braced(_section("### Record batches"), '{"batch_id"')
     | {"model_revision", "head_digest"}),
    (AggregateBatch, ["aggregate_batch", "segmented_aggregate_batch",
                      "timed_aggregate_batch"],
     _braced(_section("### Aggregates"), '{"batch_id"') | {"model_revision", "head_digest"}),
    (IntervalBatch, ["interval_batch"],
     (_braced(_section("### Interval batches"), '{"batch_id"')  # columns: a test below
      - set(RecordColumns.model_fields)) | {"model_revision", "head_digest"}),
    (ThresholdSetWire, ["threshold_set", "threshold_set_for_heads"],
     _braced(_section("## Pull"), '{"deployment"') | {"segments", "head_digest"}),
]


@pytest.mark.parametrize(("model", "vectors", "named"), MESSAGES,
                         ids=[model.__name__ for model, _, _ in MESSAGES])
def test_the_protocol_names_every_field_of_each_message_and_the_vectors_use_them(
        model, vectors, named):
    assert named == set(model.model_fields), \
        f"docs/protocol.md names {sorted(named)}; {model.__name__} has " \
        f"{sorted(model.model_fields)}"
    required = {name for name, field in model.model_fields.items() if field.is_required()}
    seen: set[str] = set()
    for vector in vectors:
        payload = PAYLOADS[vector]["payload"]
        assert required <= set(payload) <= named, vector
        seen |= set(payload)
    # Every field the protocol names appears in a vector: the lineage fields in the heartbeat
    # vector's (the batches carry them alike), a set's segments in checksums.json.
    elsewhere = set(PAYLOADS["heartbeat"]["payload"]) | {
        "segments" for case in CHECKSUMS if case.get("segments")}
    assert named <= seen | elsewhere


def test_the_protocol_names_every_field_of_a_record_a_cell_a_point_and_a_heartbeat():
    records = _section("### Record batches")
    assert set(TokenRecord.model_fields) <= _ticked(records)
    assert set(ShadowPoint.model_fields) == _braced(records, '{"layer"')
    cell = _braced(_section("### Aggregates"), '{"minute"')
    assert cell == set(AggregateCell.model_fields)
    columns = _braced(_section("### Interval batches"), '"records": {')
    assert columns == set(RecordColumns.model_fields)
    assert set(Heartbeat.model_fields) <= _ticked(_section("## Heartbeat"))
    assert set(PAYLOADS["heartbeat"]["payload"]) | set(
        PAYLOADS["heartbeat_refusing"]["payload"]) == set(Heartbeat.model_fields)


def _vector_records():
    for name in ("record_batch", "segmented_record_batch", "timed_record_batch"):
        payload = PAYLOADS[name]["payload"]
        for record in payload["records"]:
            yield payload["num_layers"], record
    interval = PAYLOADS["interval_batch"]["payload"]
    for record in RecordColumns.model_validate(interval["records"]).records():
        yield interval["num_layers"], record.model_dump(mode="json")


def test_vector_records_follow_the_protocol_on_shadow_tokens():
    shadows = 0
    for num_layers, record in _vector_records():
        # signal_value too; segment, exit_checks and the shadow-request markers are left off
        # when default / not reported / false
        assert set(TokenRecord.model_fields) - {"segment", "exit_checks", "shadow_request",
                                                "request_end"} <= set(record)
        if not record.get("shadow"):
            continue
        shadows += 1
        # a shadow token runs to full depth; its signal at exit is its deepest point's
        assert record["exit_layer"] == num_layers
        deepest = max(record["shadow"], key=lambda point: point["layer"])
        assert record["signal_value"] == deepest["signal"]
        assert all(type(point["matched"]) is bool for point in record["shadow"])
    assert shadows >= 3
