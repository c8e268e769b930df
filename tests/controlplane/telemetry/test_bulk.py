"""Bulk writes of column tables read back exactly (binary COPY on PostgreSQL, executemany on
SQLite), and timestamps are the ones datetime.fromtimestamp gives."""

import random
import time
from datetime import UTC, datetime

import numpy as np
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.telemetry import bulk
from controlplane.telemetry.columns import parse_batch
from controlplane.telemetry.models import Rollup, ShadowSampleRow, TokenRecordRow
from controlplane.telemetry.tables import ROLLUP_COUNTERS, tables_of
from tests.support.batches import telemetry_batch

LAYERS = [9, 3, 6]  # deliberately not sorted: shadow samples keep the deployment's order
FULL = 12


def _payload(rng: random.Random, n: int) -> dict:
    records = []
    for i in range(n):
        record = {"threshold_version": 2, "position": i,
                  "exit_layer": rng.choice([*LAYERS, FULL]),
                  "request_id": rng.choice(["r", "req-12", "ünïcode-ß", "x" * 128, "a\tb\\c\"d"]),
                  "signal_value": rng.random(), "latency_us": rng.randint(0, 2**31 - 1),
                  # half-microsecond fractions: the rounding datetime.fromtimestamp does
                  "ts": rng.choice([time.time() + rng.random(), 1.5, 1e10 - 0.25,
                                    1.7e9 + 0.0000005 * rng.randint(0, 9)])}
        if rng.random() < 0.3:
            record["shadow"] = [{"layer": layer, "signal": rng.random(),
                                 "matched": rng.random() < 0.5}
                                for layer in rng.sample(LAYERS, len(LAYERS))]
        records.append(record)
    batch_id = f"batch-{rng.randrange(10**8):08d}"
    # runtime ids are ASCII (exitplane.wire.RuntimeId); request ids carry the odd text
    runtime_id = rng.choice(["rt-1", "node.7:gpu_0-" + "x" * 115])
    return telemetry_batch(records, batch_id=batch_id, runtime_id=runtime_id, num_layers=FULL)


def test_rows_read_back_exactly(engine):
    rng = random.Random(1)
    payloads = [_payload(rng, 300) for _ in range(3)]
    batches = [parse_batch(payload) for payload in payloads]
    tables = tables_of(deployment_id=1, exit_layers=LAYERS, num_layers=FULL, batches=batches,
                       thresholds={2: np.array([0.9, 0.5, 0.7])})
    with Session(engine) as session:
        bulk.write_rows(session, TokenRecordRow, tables.tokens)
        bulk.write_rows(session, ShadowSampleRow, tables.shadows)
        session.commit()
        stored = {(row.batch_id, row.idx): row for row in session.scalars(select(TokenRecordRow))}
        samples = {(row.batch_id, row.idx): row
                   for row in session.scalars(select(ShadowSampleRow))}
    sent = {(p["batch_id"], idx): (p, record) for p in payloads
            for idx, record in enumerate(p["records"])}
    assert stored.keys() == sent.keys()
    for key, (payload, record) in sent.items():
        row = stored[key]
        assert (row.runtime_id, row.request_id, row.threshold_version, row.position,
                row.exit_layer, row.signal_value, row.latency_us, row.shadow) == (
            payload["runtime_id"], record["request_id"], 2, record["position"],
            record["exit_layer"], record["signal_value"], record["latency_us"],
            "shadow" in record)
        assert row.ts == datetime.fromtimestamp(record["ts"], UTC)
        if "shadow" in record:
            by_layer = {point["layer"]: point for point in record["shadow"]}
            sample = samples[key]
            assert sample.ts == row.ts
            np.testing.assert_array_equal(
                np.frombuffer(sample.signals, dtype="<f4"),
                np.array([by_layer[layer]["signal"] for layer in LAYERS], dtype="<f4"))
            assert list(sample.matched) == [by_layer[layer]["matched"] for layer in LAYERS]
    assert len(samples) == sum("shadow" in record for _, record in sent.values())


def test_counts_add_onto_existing_rows(engine):
    minute = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    keys = {"deployment_id": np.array([1, 1]), "version": np.array([2, 2]),
            "runtime_id": ["rt-1", 'rt-"2"'],
            "minute": np.array([minute.replace(tzinfo=None)] * 2, dtype="datetime64[us]"),
            "layer": np.array([3, 3])}
    counts = {name: np.array([1, 2]) for name in ROLLUP_COUNTERS}
    with Session(engine) as session:
        for _ in range(2):
            bulk.add_counts(session, Rollup, keys | counts, ROLLUP_COUNTERS)
        session.commit()
        rows = {row.runtime_id: row for row in session.scalars(select(Rollup))}
    assert [getattr(rows["rt-1"], name) for name in ROLLUP_COUNTERS] == [2] * 6
    assert rows['rt-"2"'].tokens == 4 and rows['rt-"2"'].minute == minute


def test_binary_copy_groups_rows_by_their_text_widths():
    table = {"batch_id": ["a" * 8] * 3, "idx": np.arange(3),
             "ts": np.array(["2026-01-01T00:00:00"] * 3, dtype="datetime64[us]"),
             "deployment_id": np.ones(3), "runtime_id": ["r", "rr", "r"],
             "threshold_version": np.zeros(3), "request_id": ["", "é", "xyz"],
             "position": np.zeros(3), "exit_layer": np.full(3, 12), "signal_value": np.ones(3),
             "latency_us": np.zeros(3), "shadow": np.zeros(3, dtype=bool)}
    payload = bulk.binary_copy(TokenRecordRow, table)
    assert payload.startswith(b"PGCOPY\n\xff\r\n\x00") and payload.endswith(b"\xff\xff")
    for text in (b"\x00\x00\x00\x00", b"\x00\x00\x00\x02\xc3\xa9", b"\x00\x00\x00\x03xyz",
                 b"\x00\x00\x00\x02rr"):
        assert text in payload
    row_bytes = 2 + sum(4 + width for width in (8, 4, 8, 4, 1, 4, 0, 4, 2, 8, 4, 1))
    assert len(payload) == 19 + 3 * row_bytes + (1 + 2 + 3) + 2  # signature, rows, trailer


@pytest.mark.parametrize("span", [1, 7, 3_600, 10**7, 2**40])
def test_number_groups_is_what_sorting_gives(span):
    """Keys in a small span are counted into a table instead of sorted: same answer."""
    rng = np.random.default_rng(span)
    version = rng.integers(0, 3, 500)
    minute = (1_764_460_800 + rng.integers(0, span, 500)) // 60 * 60
    moment = minute.astype("datetime64[s]")
    segment = rng.choice(np.array(["default", "chat", "code"]), 500)
    values, group = bulk.number_groups(version, minute, moment, segment)
    rows = list(zip(version.tolist(), minute.tolist(), moment.tolist(), segment.tolist(),
                    strict=True))
    distinct = sorted(set(rows))
    assert [tuple(row) for row in zip(*(value.tolist() for value in values), strict=True)] == \
        distinct
    assert [distinct[number] for number in group.tolist()] == rows
