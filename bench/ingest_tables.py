"""Ingestion's column path on its own: `parse_batch` + `tables_of` (rows, rollup and histogram
increments) over a 10k-record batch shaped like bench/ingest.py's, unsegmented and with four
segments, and `aggregate_tables` over the aggregate batch of the same tokens. No store, no
HTTP: the CPU cost ingestion adds per record, which per-segment keys must not raise.

With `--against REF` the same batches also go through tables.py and bulk.py as they are at git
ref REF, interleaved call by call with today's (a shared machine's load hits both alike), and
the ratios today / REF are printed.

    .venv/bin/python bench/ingest_tables.py --records 10000 --repeats 100 --against main
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.ingest import EXIT_LAYERS, NUM_LAYERS, synthetic_batches
from controlplane.telemetry import tables
from controlplane.telemetry.columns import parse_batch
from exitplane.client.aggregate import Aggregator
from exitplane.wire import AggregateBatch, TokenRecord

ROOT = Path(__file__).resolve().parent.parent
SEGMENTS = ["default", "chat", "code", "tools"]


def tables_at(ref: str):
    """controlplane/telemetry/tables.py as at git `ref`, importing bulk.py as at `ref` too."""
    folder = Path(tempfile.mkdtemp(prefix="exitplane-tables-"))
    for name in ("tables", "bulk"):
        source = subprocess.run(["git", "show", f"{ref}:controlplane/telemetry/{name}.py"],
                                cwd=ROOT, check=True, capture_output=True, text=True).stdout
        (folder / f"ref_{name}.py").write_text(source.replace(
            "from controlplane.telemetry.bulk import", "from ref_bulk import"))
    sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location("ref_tables", folder / "ref_tables.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["ref_tables"] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--shadow-rate", type=float, default=0.05)
    parser.add_argument("--against", help="git ref to compare tables.py/bulk.py with")
    args = parser.parse_args()
    [plain] = synthetic_batches(args.records, args.records, args.shadow_rate)
    segmented = {**plain, "records": [
        {**record, "segment": SEGMENTS[index % len(SEGMENTS)]} if index % len(SEGMENTS)
        else record for index, record in enumerate(plain["records"])]}
    payloads = {"plain": plain, "segmented": segmented}
    columns = {label: parse_batch(payload) for label, payload in payloads.items()}
    aggregates = {}
    for label, payload in payloads.items():
        aggregator = Aggregator(exit_layers=EXIT_LAYERS, num_layers=NUM_LAYERS)
        for record in payload["records"]:
            aggregator.add(TokenRecord.model_validate(record))
        aggregates[label] = AggregateBatch(
            batch_id="bench-aggregate", deployment="bench", runtime_id="rt-0", seq=0,
            num_layers=NUM_LAYERS, raw_sample_rate=0.0, cells=aggregator.cut())
    modules = {"now": tables} | ({"ref": tables_at(args.against)} if args.against else {})
    thresholds = {2: np.full(len(EXIT_LAYERS), 0.9)}
    calls = {}
    for label in payloads:
        calls[f"{label}_parse"] = lambda p=payloads[label]: parse_batch(p)
        for name, module in modules.items():
            calls[f"{label}_tables_{name}"] = lambda m=module, c=columns[label]: m.tables_of(
                deployment_id=1, exit_layers=EXIT_LAYERS, num_layers=NUM_LAYERS, batches=[c],
                thresholds=thresholds)
            calls[f"{label}_aggregate_tables_{name}"] = \
                lambda m=module, a=aggregates[label]: m.aggregate_tables(
                    deployment_id=1, exit_layers=EXIT_LAYERS, num_layers=NUM_LAYERS,
                    aggregates=[a])
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(args.repeats):  # interleaved; the best of n is the least disturbed call
        for key, call in calls.items():
            started = time.perf_counter()
            call()
            best[key] = min(best[key], time.perf_counter() - started)
    out: dict = {"records": args.records, "shadow_rate": args.shadow_rate,
                 "repeats": args.repeats, "against": args.against}
    out |= {f"{key}_ms": round(seconds * 1e3, 4) for key, seconds in best.items()}
    for label in payloads:
        out[f"{label}_records_per_s"] = round(args.records / (
            best[f"{label}_parse"] + best[f"{label}_tables_now"]))
        out[f"{label}_aggregate_cells"] = len(aggregates[label].cells)
        if args.against:
            out[f"{label}_tables_ratio"] = round(
                best[f"{label}_tables_now"] / best[f"{label}_tables_ref"], 3)
            out[f"{label}_parse_plus_tables_ratio"] = round(
                (best[f"{label}_parse"] + best[f"{label}_tables_now"])
                / (best[f"{label}_parse"] + best[f"{label}_tables_ref"]), 3)
    print(" ".join([".venv/bin/python", "bench/ingest_tables.py", *sys.argv[1:]]))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
