"""The shipper's interval batches: one request per interval with the counts and the
records; a 413 splits cells and records in halves; a control plane that predates interval
batches (415) gets the pair they stand for, from then on; the spool keeps the record count."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import text

from controlplane.telemetry import api as telemetry_api
from exitplane.app import create_app
from exitplane.client.aggregate import Aggregator
from exitplane.client.codec import EncodedBatch, encode_interval
from exitplane.wire import (
    AGGREGATE_MSGPACK,
    INTERVAL_JSON,
    INTERVAL_MSGPACK,
    RECORDS_MSGPACK,
    IntervalBatch,
    RecordColumns,
    TelemetryBatch,
)
from tests.support.network import free_port
from tests.support.runtime_link import (
    DEPLOYMENT,
    EXIT_LAYERS,
    NUM_LAYERS,
    ControlPlane,
    fast_shipper,
    publish,
    stored_rollups,
    token_stream,
)


def _kinds(engine, runtime_id: str) -> dict:
    with engine.connect() as connection:
        return dict(connection.execute(text(
            "SELECT kind, count(*) FROM telemetry_batches WHERE runtime_id = :r GROUP BY kind"),
            {"r": runtime_id}).all())


def _records(engine, runtime_id: str) -> int:
    with engine.connect() as connection:
        return connection.execute(text(
            "SELECT count(*) FROM token_records WHERE runtime_id = :r"), {"r": runtime_id}
        ).scalar()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_an_older_control_plane_gets_the_pair_from_then_on(settings, engine, operator,
                                                           runtime_token, tmp_path,
                                                           monkeypatch):
    """The real app with the interval content types taken out, as the release before them."""
    publish(operator, {2: 0.6, 4: 0.3})
    for content_type in (INTERVAL_MSGPACK, INTERVAL_JSON):
        monkeypatch.delitem(telemetry_api._BATCH_MODELS, content_type)
    plane = ControlPlane(make_app=lambda: create_app(settings, engine=engine), port=free_port())
    plane.start()
    try:
        stream = token_stream(3000, versions=[1])
        plain = fast_shipper(plane.url, runtime_token, tmp_path / "a", "rt-records").start()
        edge = fast_shipper(plane.url, runtime_token, tmp_path / "b", "rt-edge",
                            raw_sample_rate=0.2, exit_layers=EXIT_LAYERS,
                            aggregate_interval_s=0.2).start()
        assert edge.bundle
        for record in stream:
            plain.submit(record)
            edge.submit(record)
        assert plain.flush(60) and edge.flush(60)
        assert plain.wait_replayed(60) and edge.wait_replayed(60)
        assert not edge.bundle  # the 415 turned it to the pair
        assert edge.counters["rejected_batches"] == 0
        assert edge.counters["sent_aggregate_tokens"] == len(stream)
        assert stored_rollups(engine, "rt-edge") == stored_rollups(engine, "rt-records")
        assert set(_kinds(engine, "rt-edge")) == {"aggregate", "sampled"}
        assert _records(engine, "rt-edge") == edge.counters["sent_records"] > 0
        with engine.connect() as connection:
            ids = [row[0] for row in connection.execute(text(
                "SELECT batch_id FROM telemetry_batches WHERE runtime_id = 'rt-edge' "
                "ORDER BY seq, batch_id")).all()]
        # the first batch went as what it stood for, under ids derived from its own
        assert ids[0][-1] in "cr" and len(ids[0]) == 33
        assert all(len(batch_id) == 32 for batch_id in ids[2:])  # then the pair, fresh ids
        assert plain.close(10) and edge.close(10)
    finally:
        plane.close()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_split_interval_batches_store_everything_once(settings, engine, operator,
                                                      runtime_token, tmp_path):
    publish(operator, {2: 0.5, 4: 0.5})
    small = settings.model_copy(update={"max_body_bytes": 3000})
    plane = ControlPlane(make_app=lambda: create_app(small, engine=engine), port=free_port())
    plane.start()
    try:
        stream = token_stream(2000, versions=[1])
        plain = fast_shipper(plane.url, runtime_token, tmp_path / "a", "rt-records",
                             batch_records=20).start()
        edge = fast_shipper(plane.url, runtime_token, tmp_path / "b", "rt-edge",
                            raw_sample_rate=0.3, exit_layers=EXIT_LAYERS, aggregate_interval_s=60,
                            max_attempts=1).start()
        for record in stream:
            plain.submit(record)
            edge.submit(record)
        assert plain.flush(60) and edge.flush(60)
        assert edge.wait_replayed(60) and plain.wait_replayed(60)
        assert edge.counters["splits"] >= 2 and edge.counters["rejected_batches"] == 0
        assert edge.counters["sent_aggregate_tokens"] == len(stream)
        assert stored_rollups(engine, "rt-edge") == stored_rollups(engine, "rt-records")
        assert _records(engine, "rt-edge") == edge.counters["sent_records"] > 300
        assert set(_kinds(engine, "rt-edge")) == {"aggregate"}
        assert plain.close(10) and edge.close(10)
    finally:
        plane.close()


def _encoded(records, content_type=INTERVAL_MSGPACK) -> EncodedBatch:
    aggregator = Aggregator(exit_layers=EXIT_LAYERS, num_layers=NUM_LAYERS)
    for record in records:
        aggregator.add(record)
    return encode_interval(deployment=DEPLOYMENT, runtime_id="rt", seq=7, num_layers=NUM_LAYERS,
                           raw_sample_rate=0.5, cells=aggregator.cut(),
                           records=RecordColumns.of(records), content_type=content_type)


def _leaves(batch: EncodedBatch) -> list[EncodedBatch]:
    halves = batch.split()
    return [leaf for half in halves for leaf in _leaves(half)] if halves else [batch]


@pytest.mark.parametrize("content_type", [INTERVAL_MSGPACK, INTERVAL_JSON])
def test_halves_and_the_pair_keep_every_cell_and_record(content_type):
    records = token_stream(60, versions=[1, 2], seed=3)
    assert sum(record.shadow is not None for record in records) >= 2
    batch = _encoded(records, content_type)
    whole = IntervalBatch.model_validate(batch.decode())
    assert batch.rows == len(records) and batch.records == len(records) == whole.tokens

    halves = batch.split()
    assert [half.batch_id for half in halves] == [batch.batch_id + "a", batch.batch_id + "b"]
    assert [h.batch_id for h in batch.split()] == [h.batch_id for h in halves]  # replays match
    leaves = _leaves(batch)
    assert len(leaves) == len(whole.cells) + len(records)  # down to one item each
    parts = [IntervalBatch.model_validate(leaf.decode()) for leaf in leaves]
    assert all(len(part.cells) + (len(part.records) if part.records else 0) == 1
               for part in parts)
    assert [cell for part in parts for cell in part.cells] == whole.cells
    assert [r for part in parts if part.records for r in part.records.records()] == records
    assert sum(leaf.records for leaf in leaves) == batch.records
    assert sum(leaf.rows for leaf in leaves) == batch.rows
    assert {leaf.seq for leaf in leaves} == {7}

    aggregate, sampled = batch.unbundled()
    assert (aggregate.batch_id, sampled.batch_id) == (batch.batch_id + "c", batch.batch_id + "r")
    assert aggregate.content_type == (AGGREGATE_MSGPACK if "msgpack" in content_type
                                      else "application/vnd.exitplane.aggregate+json")
    assert sampled.content_type == (RECORDS_MSGPACK if "msgpack" in content_type
                                    else "application/json")
    assert aggregate.records == whole.tokens and sampled.records == len(records)
    as_records = TelemetryBatch.model_validate(sampled.decode())
    assert as_records.records == records and as_records.aggregated
    assert aggregate.decode()["cells"] == batch.decode()["cells"]


def test_the_spool_record_keeps_the_rows_and_reads_older_records():
    batch = _encoded(token_stream(10, versions=[1]))
    assert EncodedBatch.unpack(batch.pack()) == batch
    older = EncodedBatch(uuid.uuid4().hex, 3, 12, AGGREGATE_MSGPACK, b"\x80")
    assert EncodedBatch.unpack(older.pack()) == older and older.rows == 0
