"""Write the protocol test vectors under docs/vectors/ (deterministic: same files every run).

    python scripts/vectors.py

A runtime written in another language checks itself against these files (docs/protocol.md,
"Test vectors"); tests/test_vectors.py checks them against this code.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VECTORS = ROOT / "docs" / "vectors"


def checksums() -> list[dict]:
    """Threshold sets: the canonical JSON and the sha256 (the ETag) of each."""
    from exitplane.wire import canonical_json, threshold_checksum

    cases = [
        ("chat", 1, "learned", {8: 1.0, 16: 1.0, 24: 1.0}, "the never-exit set"),
        ("chat", 7, "maxprob", {24: 0.95, 8: 0.9, 16: 0.875}, "keys sorted as strings"),
        ("chat", 3, "entropy", {3: 0.1, 6: 0.25, 12: 1e-05}, "'12' sorts before '3'; 1e-05"),
        ("llama-70b.eu", 12, "margin", {2: 0, 4: 1}, "integers are written as floats"),
        ("tiny", 0, "learned", {2: 1.0, 4: 1.0}, "version 0: the built-in conservative set"),
        ("chat", 2, "saturation", {5: 0.3333333333333333, 10: 0.7000000000000001},
         "shortest round-trip float repr"),
    ]
    # Per-segment thresholds: the map enters the canonical JSON, sorted at every
    # level; the sets above have none, so their checksum leaves the field out.
    segmented = ("mixed", 4, "learned", {12: 0.9, 6: 0.95},
                 "segments: sorted names and layers; 'default' is `thresholds`",
                 {"code": {6: 1, 12: 0.99}, "chat": {12: 0.8, 6: 0.875}})
    # A set made for named exit heads (lineage): the digest enters the canonical JSON.
    made_for = ("chat", 9, "learned", {16: 0.9, 8: 0.95},
                "head_digest: the exit heads the set was made for", None, HEAD_DIGEST)
    out = []
    for deployment, version, signal, thresholds, note, *rest in [*cases, segmented, made_for]:
        segments = rest[0] if rest else None
        head_digest = rest[1] if len(rest) > 1 else None
        body = {"deployment": deployment, "version": version, "signal": signal,
                "thresholds": _layer_map(thresholds)}
        case = {"note": note, "deployment": deployment, "version": version, "signal": signal,
                "thresholds": {str(k): v for k, v in thresholds.items()}}
        if segments:
            body["segments"] = {name: _layer_map(m) for name, m in segments.items()}
            case["segments"] = {name: {str(k): v for k, v in m.items()}
                                for name, m in segments.items()}
        if head_digest:
            body["head_digest"] = case["head_digest"] = head_digest
        out.append({**case, "canonical_json": canonical_json(body).decode(),
                    "checksum": threshold_checksum(deployment=deployment, version=version,
                                                   signal=signal, thresholds=thresholds,
                                                   segments=segments,
                                                   head_digest=head_digest)})
    return out


# The lineage the vectors name: an exit-heads artifact's sha256 and a model revision.
HEAD_DIGEST = "3f1a9c0e5b7d2468ace13579bdf02468ace13579bdf02468ace13579bdf0246a"
MODEL_REVISION = "smollm2-135m-instruct@5d5b8d1"


def _layer_map(thresholds: dict[int, float]) -> dict[str, float]:
    return {str(layer): float(value) for layer, value in sorted(thresholds.items())}


def _records(count: int, seed: int) -> list[dict]:
    """Token records of deployment `tiny` (6 layers, exits at 2 and 4), over two minutes."""
    rng = random.Random(seed)
    records = []
    for index in range(count):
        shadow = index % 9 == 4
        layer = 6 if shadow else rng.choice([2, 2, 4, 6])
        record = {"threshold_version": rng.choice([0, 3]), "request_id": f"req-{index // 6}",
                  "position": index % 6, "exit_layer": layer,
                  "signal_value": [0.0, 0.05, 0.5, 0.999, 1.0][index % 5] if index < 10
                  else round(rng.random(), 6),
                  "latency_us": 900 + index, "ts": 1_764_460_790.25 + 4.5 * index,
                  "shadow": [{"layer": k, "signal": round(rng.random(), 6),
                              "matched": rng.random() < 0.8} for k in (2, 4)]
                  if shadow else None}
        if shadow:  # a shadow token's signal at exit is its deepest exit layer's (protocol)
            record["signal_value"] = record["shadow"][-1]["signal"]
        records.append(record)
    return records


def payloads() -> dict:
    """A record batch (JSON and msgpack), the aggregate batch its tokens make, an interval
    batch, a heartbeat, a threshold set as pulled, and payloads the control plane refuses."""
    import msgpack

    from exitplane.client.aggregate import Aggregator
    from exitplane.wire import (
        AggregateBatch,
        IntervalBatch,
        RecordColumns,
        ThresholdPull,
        ThresholdSetWire,
        TokenRecord,
        pull_etag,
    )

    records = _records(24, seed=14)
    batch = {"batch_id": "0f3c2a9e5b7d4e1f8a6c3b2d1e0f9a8b", "deployment": "tiny",
             "runtime_id": "rt-1", "seq": 41, "num_layers": 6, "records": records,
             "aggregated": False}
    aggregator = Aggregator(exit_layers=[2, 4], num_layers=6)
    for record in records:
        aggregator.add(TokenRecord.model_validate(record))
    aggregate = AggregateBatch(batch_id="7e1d0c9b8a7f6e5d4c3b2a1908f7e6d5", deployment="tiny",
                               runtime_id="rt-1", seq=42, num_layers=6, raw_sample_rate=0.01,
                               cells=aggregator.cut()).model_dump(mode="json")
    # Traffic segments: the same shapes with a `segment` on records and cells,
    # left off where it is `default` (so record_batch above is byte-for-byte unsegmented).
    segmented_records = _records(18, seed=15)
    for index, record in enumerate(segmented_records):
        segment = ("default", "chat", "code")[index % 3]
        if segment != "default":
            record["segment"] = segment
    segmented_batch = {**batch, "batch_id": "5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d", "seq": 43,
                       "records": segmented_records}
    aggregator = Aggregator(exit_layers=[2, 4], num_layers=6)
    for record in segmented_records:
        aggregator.add(TokenRecord.model_validate(record))
    segmented_aggregate = AggregateBatch(
        batch_id="9d8c7b6a5f4e3d2c1b0a9f8e7d6c5b4a", deployment="tiny", runtime_id="rt-1",
        seq=44, num_layers=6, raw_sample_rate=0.01, cells=aggregator.cut()
    ).model_dump(mode="json")
    # An interval batch: the counts of segmented_record_batch's 18 tokens and, column by
    # column, the records an aggregating runtime ships of them (its shadow tokens and, here,
    # every third of the others as the raw sample).
    carried = [TokenRecord.model_validate(record) for index, record in
               enumerate(segmented_records) if record["shadow"] or index % 3 == 0]
    interval = IntervalBatch(
        batch_id="3c2b1a0f9e8d7c6b5a4f3e2d1c0b9a8f", deployment="tiny", runtime_id="rt-1",
        seq=45, num_layers=6, raw_sample_rate=0.33, cells=segmented_aggregate["cells"],
        records=RecordColumns.of(carried)).model_dump(mode="json")
    # Timed tokens: each record's exit checks (one per exit layer at or below its exit) and a
    # wall time that follows them; the cells of those tokens carry their summed costs.
    timed_records = _records(12, seed=16)
    for record in timed_records:
        record["exit_checks"] = sum(layer <= record["exit_layer"] for layer in (2, 4))
        record["latency_us"] = 120 + 40 * record["exit_layer"] + 15 * record["exit_checks"]
    timed_batch = {**batch, "batch_id": "b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6", "seq": 46,
                   "records": timed_records}
    aggregator = Aggregator(exit_layers=[2, 4], num_layers=6)
    for record in timed_records:
        aggregator.add(TokenRecord.model_validate(record))
    timed_aggregate = AggregateBatch(
        batch_id="c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7", deployment="tiny", runtime_id="rt-1",
        seq=47, num_layers=6, raw_sample_rate=0.01, cells=aggregator.cut()
    ).model_dump(mode="json")
    # A shadow request: one request served at full depth, each of its tokens in order with a
    # point at every exit layer, the last one marked request_end.
    rng = random.Random(17)
    shadow_request = []
    for position in range(5):
        points = [{"layer": layer, "signal": round(rng.random(), 6),
                   "matched": rng.random() < 0.7} for layer in (2, 4)]
        shadow_request.append({
            "threshold_version": 3, "request_id": "req-shadow-1", "position": position,
            "exit_layer": 6, "signal_value": points[-1]["signal"],
            "latency_us": 2100 + 10 * position, "ts": 1_764_460_900.5 + 0.25 * position,
            "shadow": points, "exit_checks": 2, "segment": "chat", "shadow_request": True,
            **({"request_end": True} if position == 4 else {})})
    shadow_request_batch = {**batch, "batch_id": "d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a8",
                            "seq": 48, "records": shadow_request}
    threshold_set = ThresholdSetWire.build(deployment="tiny", version=3, signal="maxprob",
                                           thresholds={2: 0.9, 4: 0.75}).model_dump(mode="json")
    for_heads = ThresholdSetWire.build(deployment="tiny", version=4, signal="learned",
                                       thresholds={2: 0.9, 4: 0.75},
                                       head_digest=HEAD_DIGEST).model_dump(mode="json")
    refused = [
        {"note": "exit_layer beyond num_layers", "content_type": "application/json",
         "payload": {**batch, "records": [{**records[0], "exit_layer": 7}]},
         "status": 422, "detail_contains": "exit_layer 7 exceeds num_layers 6"},
        {"note": "signal outside [0, 1]", "content_type": "application/json",
         "payload": {**batch, "records": [{**records[0], "signal_value": 1.5}]},
         "status": 422, "detail_contains": "record 0"},
        {"note": "a shadow repeats an exit layer", "content_type": "application/json",
         "payload": {**batch, "records": [{**records[4], "shadow": [
             {"layer": 2, "signal": 0.5, "matched": True}] * 2}]},
         "status": 422, "detail_contains": "shadow points repeat an exit layer"},
        {"note": "histogram counts more tokens than exited",
         "content_type": "application/vnd.exitplane.aggregate+json",
         "payload": {**aggregate, "cells": [{**aggregate["cells"][0], "exits": 0}]},
         "status": 422, "detail_contains": "more than the 0 that exited"},
        {"note": "minute not on a minute boundary",
         "content_type": "application/vnd.exitplane.aggregate+json",
         "payload": {**aggregate, "cells": [{**aggregate["cells"][0], "minute": 1764460801}]},
         "status": 422, "detail_contains": "multiple of 60"},
        {"note": "cells account for more tokens than a batch may (2**40)",
         "content_type": "application/vnd.exitplane.aggregate+json",
         "payload": {**aggregate, "cells": [{**cell, "exits": 2**39 + 1}
                                            for cell in aggregate["cells"][:2]]},
         "status": 422, "detail_contains": "more than a batch may (1099511627776)"},
        {"note": "interval record columns of different lengths",
         "content_type": "application/vnd.exitplane.interval+json",
         "payload": {**interval, "records": {**interval["records"],
                                             "position": interval["records"]["position"][1:]}},
         "status": 422, "detail_contains": "column position has"},
        {"note": "an interval shadow point names no record",
         "content_type": "application/vnd.exitplane.interval+json",
         "payload": {**interval, "records": {
             **interval["records"],
             "shadow_record": [*interval["records"]["shadow_record"][:-1], 99]}},
         "status": 422, "detail_contains": "shadow_record 99 names no record"},
        {"note": "a shadow-request token that did not run to full depth",
         "content_type": "application/json",
         "payload": {**shadow_request_batch,
                     "records": [{**shadow_request[0], "exit_layer": 4}]},
         "status": 422, "detail_contains": "a shadow_request token runs at full depth"},
        {"note": "a shadow-request token without shadow points",
         "content_type": "application/json",
         "payload": {**shadow_request_batch,
                     "records": [{**shadow_request[0], "shadow": None}]},
         "status": 422, "detail_contains": "carries the shadow points"},
        {"note": "a head digest with a character outside [A-Za-z0-9_.:+-]",
         "content_type": "application/json",
         "payload": {**batch, "records": batch["records"][:1], "head_digest": "sha256 3f1a"},
         "status": 422, "detail_contains": "head_digest"},
    ]
    return {
        "record_batch": {"content_type": "application/json", "payload": batch,
                         "msgpack_hex": msgpack.packb(batch, use_bin_type=True).hex()},
        "aggregate_batch": {
            "note": "the exact counts of record_batch's 24 tokens (what an aggregating runtime "
                    "sends instead of the tokens): exits and signal histogram per (minute, "
                    "threshold_version, layer), cells sorted by (minute, version, layer), "
                    "empty cells left out",
            "content_type": "application/vnd.exitplane.aggregate+json", "payload": aggregate,
            "msgpack_content_type": "application/vnd.exitplane.aggregate+msgpack",
            "msgpack_hex": msgpack.packb(aggregate, use_bin_type=True).hex()},
        "segmented_record_batch": {
            "note": "records of three traffic segments: `segment` on each record, left off "
                    "for `default`",
            "content_type": "application/json", "payload": segmented_batch,
            "msgpack_hex": msgpack.packb(segmented_batch, use_bin_type=True).hex()},
        "segmented_aggregate_batch": {
            "note": "the exact counts of segmented_record_batch's 18 tokens: one cell per "
                    "(minute, threshold_version, segment, layer), sorted so, `segment` left "
                    "off for `default`",
            "content_type": "application/vnd.exitplane.aggregate+json",
            "payload": segmented_aggregate,
            "msgpack_content_type": "application/vnd.exitplane.aggregate+msgpack",
            "msgpack_hex": msgpack.packb(segmented_aggregate, use_bin_type=True).hex()},
        "interval_batch": {
            "note": "one request per interval: the cells of segmented_aggregate_batch and, "
                    "column by column, the records shipped of its tokens (entry i of each "
                    "record column is record i; shadow point j belongs to record "
                    "shadow_record[j]; `segment` left off when every record is default)",
            "content_type": "application/vnd.exitplane.interval+json", "payload": interval,
            "msgpack_content_type": "application/vnd.exitplane.interval+msgpack",
            "msgpack_hex": msgpack.packb(interval, use_bin_type=True).hex()},
        "timed_record_batch": {
            "note": "timed tokens: each record's `exit_checks` beside its `latency_us` (a "
                    "record without `exit_checks` is served, not timed)",
            "content_type": "application/json", "payload": timed_batch,
            "msgpack_hex": msgpack.packb(timed_batch, use_bin_type=True).hex()},
        "timed_aggregate_batch": {
            "note": "the exact counts of timed_record_batch's 12 tokens: each cell's "
                    "`latency_us` and `exit_checks` are the sums over its `exits` tokens",
            "content_type": "application/vnd.exitplane.aggregate+json",
            "payload": timed_aggregate,
            "msgpack_content_type": "application/vnd.exitplane.aggregate+msgpack",
            "msgpack_hex": msgpack.packb(timed_aggregate, use_bin_type=True).hex()},
        "shadow_request_batch": {
            "note": "the tokens of one shadow request (served at full depth): every token "
                    "`shadow_request` with a point at every exit layer, in position order, the "
                    "last one `request_end`; both markers left off when false",
            "content_type": "application/json", "payload": shadow_request_batch,
            "msgpack_hex": msgpack.packb(shadow_request_batch, use_bin_type=True).hex()},
        "threshold_set": {"etag": f'"{threshold_set["checksum"]}"', "payload": threshold_set},
        "threshold_pull_with_rates": {
            "note": "a pull answer to a runtime that sent applies_shadow_rate=true while the "
                    "control plane sets both rates: the ETag carries them (.s<rate>.r<rate>), "
                    "the checksum does not",
            "etag": f'"{pull_etag(threshold_set["checksum"], 0.05, 0.01)}"',
            "payload": ThresholdPull(**threshold_set, shadow_rate=0.05,
                                     shadow_request_rate=0.01).model_dump(mode="json")},
        "threshold_set_for_heads": {
            "note": "a set made for the exit heads `head_digest` (part of the checksum): a "
                    "runtime serving other heads refuses it; one that does not know its heads "
                    "applies it",
            "etag": f'"{for_heads["checksum"]}"', "payload": for_heads},
        "heartbeat": {
            "note": "model_revision and head_digest: what the runtime serves (lineage); left "
                    "out when unknown. Record, aggregate and interval batches carry the same "
                    "two fields",
            "payload": {"runtime_id": "rt-1", "model_revision": MODEL_REVISION,
                        "head_digest": HEAD_DIGEST, "applied_version": 3,
                        "applied_checksum": threshold_set["checksum"], "ready": True,
                        "error": None, "spooled_batches": 0, "dropped_records": 0}},
        "heartbeat_refusing": {
            "note": "a runtime that refused set v4 (its exit layers are not the runtime's) and "
                    "keeps serving v3: refused_version names the set, error says why; "
                    "refused_version is left out when the runtime refuses none",
            "payload": {"runtime_id": "rt-1", "applied_version": 3,
                        "applied_checksum": threshold_set["checksum"], "ready": False,
                        "error": "refused threshold set: set v4 has exit layers [6, 9]; this "
                                 "runtime exits at [12, 15]",
                        "spooled_batches": 0, "dropped_records": 0, "refused_version": 4}},
        "refused": refused,
    }


def main() -> int:
    sys.path.insert(0, str(ROOT))
    VECTORS.mkdir(parents=True, exist_ok=True)
    for name, content in (("checksums.json", checksums()), ("payloads.json", payloads())):
        (VECTORS / name).write_text(json.dumps(content, indent=2) + "\n")
        print(f"wrote docs/vectors/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
