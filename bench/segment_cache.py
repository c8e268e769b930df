"""What segment names one runtime token can make an API process hold and log: resident memory
and warning lines of a real API process (uvicorn, SQLite, embedded: it stores what it takes)
while one pattern runs, each pattern against a fresh process.

Patterns (the deployment declares no segment and does not register names from telemetry):
- `new_names`: 400 record batches, each of 33 records under 32 names never seen before and
  `default` (the most a batch may carry at the default cap of 16): 12,800 names in all.
- `wide_aggregates`: 12 aggregate batches of 30,000 cells, each cell a new name (within the
  API's decode budget).

Prints the command, then one JSON line per pattern: RSS after a warm-up and after the pattern
(MiB), growth, warning lines the process wrote about names stored as `default`, and the
answers' status codes. `--tree DIR` runs another checkout's code (e.g. `git archive HEAD`
unpacked) on the same patterns.

    .venv/bin/python bench/segment_cache.py
    .venv/bin/python bench/segment_cache.py --tree /tmp/before
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent))
from telemetry_bounds import ROOT, Api

AGGREGATE = "application/vnd.exitplane.aggregate+msgpack"


def _records(names: list[str], seq: int) -> bytes:
    now = time.time()
    records = [{"threshold_version": 2, "request_id": f"r{i}", "position": i, "exit_layer": 12,
                "signal_value": 0.5, "latency_us": 10, "ts": now, "segment": name}
               for i, name in enumerate(names)]
    return msgpack.packb({"batch_id": uuid.uuid4().hex, "deployment": "chat",
                          "runtime_id": "rt-1", "seq": seq, "num_layers": 12,
                          "records": records})


def _aggregate(names: list[str], seq: int) -> bytes:
    minute = int(time.time()) // 60 * 60
    cells = [{"minute": minute, "threshold_version": 2, "layer": 12, "exits": 1, "segment": name,
              "histogram": [1] + [0] * 19} for name in names]
    return msgpack.packb({"batch_id": uuid.uuid4().hex, "deployment": "chat",
                          "runtime_id": "rt-1", "seq": seq, "num_layers": 12,
                          "raw_sample_rate": 0.0, "cells": cells})


def new_names(seq: int) -> tuple[bytes, str]:
    names = [f"n{seq}x{index}" for index in range(32)] + ["default"]
    return _records(names, seq), "application/msgpack"


def wide_aggregates(seq: int) -> tuple[bytes, str]:
    return _aggregate([f"w{seq}x{index}" for index in range(30_000)], seq), AGGREGATE


PATTERNS = {"new_names": (new_names, 400, 20), "wide_aggregates": (wide_aggregates, 12, 1)}


def run(tree: Path, name: str) -> dict:
    make, count, warm = PATTERNS[name]
    with tempfile.TemporaryDirectory() as workdir:
        log = Path(workdir) / "api.log"
        with log.open("w") as out:
            api = Api(tree, Path(workdir), output=out)
            try:
                statuses: collections.Counter = collections.Counter()
                with httpx.Client(base_url=api.url, headers=api.runtime, timeout=300) as client:
                    def post(seq: int) -> None:
                        body, content_type = make(seq)
                        statuses[client.post("/v1/telemetry", content=body, headers={
                            "Content-Type": content_type}).status_code] += 1

                    for seq in range(warm):  # the allocator's pools, the first batch's paths
                        post(10_000 + seq)
                    time.sleep(1)
                    before = api.rss_mib()
                    for seq in range(count):
                        post(seq)
                    time.sleep(1)
                    after = api.rss_mib()
            finally:
                api.close()
        lines = sum("'default'" in line for line in log.read_text().splitlines())
    return {"pattern": name, "tree": str(tree), "batches": count,
            "rss_before_mib": round(before, 1),
            "rss_after_mib": round(after, 1), "growth_mib": round(after - before, 1),
            "default_log_lines": lines, "statuses": dict(statuses)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose code runs")
    parser.add_argument("--pattern", choices=sorted(PATTERNS), action="append",
                        help="only this pattern (repeatable); default: all")
    args = parser.parse_args()
    print("command:", " ".join([Path(sys.executable).name, *sys.argv]), flush=True)
    for name in args.pattern or sorted(PATTERNS):
        print(json.dumps(run(args.tree.resolve(), name)), flush=True)


if __name__ == "__main__":
    main()
