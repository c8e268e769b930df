"""Ingestion's column path on its own: `parse_batch` + `tables_of` (rows, rollup and histogram
increments) over 10k-record batches shaped like bench/ingest.py's, unsegmented and with a mix of
segments, and `aggregate_tables` over an aggregate batch with the same tokens. No store, no
HTTP: the CPU cost ingestion adds per record, which issue 18 must not raise.

    .venv/bin/python bench/ingest_tables.py --records 10000 --repeats 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.ingest import EXIT_LAYERS, NUM_LAYERS, synthetic_batches
from controlplane.telemetry.columns import parse_batch
from controlplane.telemetry.tables import aggregate_tables, tables_of
from exitplane.client.aggregate import Aggregator
from exitplane.wire import AggregateBatch, TokenRecord

SEGMENTS = ["default", "chat", "code", "tools"]


def _best(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls (the machine is shared: the median is steadier)."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--shadow-rate", type=float, default=0.05)
    args = parser.parse_args()
    [plain] = synthetic_batches(args.records, args.records, args.shadow_rate)
    segmented = {**plain, "records": [
        {**record, "segment": SEGMENTS[index % len(SEGMENTS)]}
        if SEGMENTS[index % len(SEGMENTS)] != "default" else record
        for index, record in enumerate(plain["records"])]}
    thresholds = {2: np.full(len(EXIT_LAYERS), 0.9)}
    out = {"records": args.records, "shadow_rate": args.shadow_rate}
    for label, payload in (("plain", plain), ("segmented", segmented)):
        columns = parse_batch(payload)
        out[f"{label}_parse_s"] = _best(lambda p=payload: parse_batch(p), args.repeats)
        out[f"{label}_tables_s"] = _best(lambda c=columns: tables_of(
            deployment_id=1, exit_layers=EXIT_LAYERS, num_layers=NUM_LAYERS, batches=[c],
            thresholds=thresholds), args.repeats)
        out[f"{label}_records_per_s"] = args.records / (out[f"{label}_parse_s"]
                                                        + out[f"{label}_tables_s"])
        aggregator = Aggregator(exit_layers=EXIT_LAYERS, num_layers=NUM_LAYERS)
        for record in payload["records"]:
            aggregator.add(TokenRecord.model_validate(record))
        aggregate = AggregateBatch(batch_id="bench-aggregate", deployment="bench",
                                   runtime_id="rt-0", seq=0, num_layers=NUM_LAYERS,
                                   raw_sample_rate=0.0, cells=aggregator.cut())
        out[f"{label}_aggregate_cells"] = len(aggregate.cells)
        out[f"{label}_aggregate_tables_s"] = _best(lambda a=aggregate: aggregate_tables(
            deployment_id=1, exit_layers=EXIT_LAYERS, num_layers=NUM_LAYERS, aggregates=[a]),
            args.repeats)
    print(" ".join([".venv/bin/python", "bench/ingest_tables.py", *sys.argv[1:]]))
    print(json.dumps({name: round(value, 6) if isinstance(value, float) else value
                      for name, value in out.items()}))


if __name__ == "__main__":
    main()
