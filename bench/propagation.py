"""Propagation benchmark: how long an alias move takes to reach N runtimes
that each hold a long-poll, split over two API processes sharing Redis (the move is made
through API A; B hears it through Redis pub/sub).

The fleet benchmark's topology (bench/fleet.py: two APIs, ingest worker, Celery worker and
beat, PostgreSQL, a private Redis) with N simulated runtimes that only long-poll (no
telemetry load), so the figure is the protocol's and the API's, not a loaded store's. Each of
`--moves` moves publishes and activates a new set; per move: the delay until the last runtime
holds it, and the p50/p99 over runtimes.

    . var/services/env  # EXITPLANE_BENCH_POSTGRES_URL
    .venv/bin/python bench/propagation.py --runtimes 1000 --moves 5

Prints the command, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.fleet import (  # noqa: E402
    EXIT_LAYERS,
    NUM_LAYERS,
    CpuMeter,
    Fleet,
    Topology,
    make_tokens,
    propagation,
)


async def run(args) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="exitplane-propagation-"))
    topology = Topology(args.postgres_url, workdir, drift_interval_s=3600)
    try:
        admin = {"Authorization": "Bearer " + topology.exitplane(
            "bootstrap", "token", "--name", "bench", "--scope", "admin")}
        httpx.post(f"{topology.urls[0]}/v1/deployments", headers=admin, timeout=30, json={
            "name": "fleet", "model_ref": "bench", "num_layers": NUM_LAYERS,
            "exit_layers": EXIT_LAYERS, "delta": 0.01}).raise_for_status()
        published = httpx.post(f"{topology.urls[0]}/v1/deployments/fleet/threshold-sets",
                               headers=admin, timeout=30, json={
                                   "thresholds": {"8": 0.9, "16": 0.8, "24": 0.7},
                                   "reason": "bench", "activate": True})
        published.raise_for_status()
        fleet = Fleet(topology, "fleet", make_tokens(topology, "fleet", args.runtimes),
                      aggregate=True, rate=0.0, ship_interval_s=3600, raw_sample_rate=0.01,
                      shadow_rate=0.01, heartbeat_s=0, version=2,
                      etag=published.json()["checksum"])
        await fleet.start()
        await fleet.grow(args.runtimes)
        moves = []
        meter = CpuMeter(topology)
        for _ in range(args.moves):
            deadline = time.monotonic() + 60
            while fleet.pulls_holding < args.runtimes and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            await asyncio.sleep(args.settle_s)
            held = fleet.pulls_holding
            before = await asyncio.to_thread(meter.sample)
            moved = await propagation(fleet, admin, timeout=args.timeout_s)
            after = await asyncio.to_thread(meter.sample)
            moved["long_polls_held"] = held
            # CPU-seconds each component spent on the move (per "million tokens" of 1e6:
            # the split's scale is one when given a million).
            moved["cpu_s"] = CpuMeter.split(before, after, 1_000_000)
            print(json.dumps(moved), file=sys.stderr, flush=True)
            moves.append(moved)
        await fleet.close()
        last = [m["propagation_max_ms"] for m in moves]
        return {"runtimes": args.runtimes, "moves": len(moves),
                "propagation_max_ms_median": round(float(np.median(last)), 1),
                "propagation_max_ms_worst": max(last),
                "propagation_p99_ms_median": round(float(np.median(
                    [m["propagation_p99_ms"] for m in moves])), 1),
                "all_propagated": all(m["propagated"] == f"{args.runtimes}/{args.runtimes}"
                                      for m in moves),
                "per_move": moves, "cpus": os.cpu_count(),
                "loadavg_1m": round(os.getloadavg()[0], 2)}
    finally:
        topology.close()
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--postgres-url", default=os.environ.get("EXITPLANE_BENCH_POSTGRES_URL"))
    parser.add_argument("--runtimes", type=int, default=1000)
    parser.add_argument("--moves", type=int, default=5)
    parser.add_argument("--settle-s", type=float, default=3.0,
                        help="wait after every runtime holds its long-poll, before a move")
    parser.add_argument("--timeout-s", type=float, default=30.0)
    args = parser.parse_args()
    if not args.postgres_url:
        parser.error("give --postgres-url or set EXITPLANE_BENCH_POSTGRES_URL "
                     "(. var/services/env)")
    print("command: " + " ".join([Path(sys.executable).name, *sys.argv]), flush=True)
    print(json.dumps(asyncio.run(run(args))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
