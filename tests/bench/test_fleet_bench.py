"""bench/fleet.py's simulated runtimes build their record columns as an interval batch carries
them: the batch they encode validates and decodes with every record (the fleet, abuse and
replica benches ship these batches)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import msgpack
import numpy as np

from exitplane.wire import IntervalBatch, RecordColumns
from tests.support.benches import load_bench


def _bench():
    return load_bench("fleet")


def test_simulated_record_columns_encode_as_a_valid_interval_batch():
    fleet = _bench()
    runtime = SimpleNamespace(columns=fleet._no_columns(), version=3, shifted=False)
    harness = SimpleNamespace(rng=np.random.default_rng(0))
    mix = np.full(len(fleet.SLOTS), 1 / len(fleet.SLOTS))
    for _ in range(3):
        fleet.Fleet._columns(harness, runtime, shadow=2, sampled=5, mix=mix, now=time.time())
    records = RecordColumns.model_construct(**runtime.columns)
    batch = fleet.encode_interval(deployment="d", runtime_id="rt-0", seq=0,
                                  num_layers=fleet.NUM_LAYERS, raw_sample_rate=0.1, cells=[],
                                  records=records)
    decoded = IntervalBatch.model_validate(msgpack.unpackb(batch.body, raw=False))
    assert len(decoded.records.ts) == 21
    assert sum(1 for layer in decoded.records.exit_layer if layer == fleet.NUM_LAYERS) >= 6
