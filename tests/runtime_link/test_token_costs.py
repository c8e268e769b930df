"""Token costs on the client's wire: record columns keep each record's exit checks through an
interval batch's split and unbundling, and a runtime that reports none sends no such column."""

import random

from exitplane.client.codec import encode_interval
from exitplane.wire import INTERVAL_JSON, IntervalBatch, RecordColumns, TelemetryBatch, TokenRecord
from tests.support.costs import KnownCost, timed_records
from tests.support.deployments import FULL


def _interval(records: list[dict]):
    tokens = [TokenRecord.model_validate(record) for record in records]
    return encode_interval(deployment="chat", runtime_id="rt-1", seq=3, num_layers=FULL,
                           raw_sample_rate=1.0, cells=[], records=RecordColumns.of(tokens),
                           content_type=INTERVAL_JSON)


def test_split_and_unbundled_intervals_keep_each_records_checks():
    records = timed_records(random.Random(1), 9, KnownCost(), shadow_rate=0.3)
    records[4].pop("exit_checks")  # one record that does not report its checks
    whole = _interval(records)
    halves = whole.split()
    assert len(halves) == 2
    checks = []
    for half in halves:
        columns = IntervalBatch.model_validate(half.decode()).records
        assert len(columns.exit_checks) == len(columns)
        checks += columns.exit_checks
    assert checks == [record.get("exit_checks") for record in records]
    [unbundled] = whole.unbundled()
    sent = TelemetryBatch.model_validate(unbundled.decode()).records
    assert [record.exit_checks for record in sent] == checks


def test_records_without_checks_send_no_column():
    records = timed_records(random.Random(2), 5, KnownCost(), timed=False)
    payload = _interval(records).decode()
    assert "exit_checks" not in payload["records"]
    assert IntervalBatch.model_validate(payload).records.exit_checks is None
