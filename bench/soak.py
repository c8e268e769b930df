"""Soak: steady ingestion plus 100 runtimes polling their thresholds, on loopback, for a while
(default 10 minutes), with an alias move every 30 s so pollers also fetch new sets.

    .venv/bin/python bench/soak.py --seconds 600 --runtimes 100 --records-per-s 2000
    .venv/bin/python bench/soak.py --seconds 60 --database-url postgresql+psycopg://...

Reports throughput, p50/p99 latencies and error counts per path, and checks stored == sent.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent))
from config_pull import free_port, wait_ready

from exitplane.wire import default_exit_layers

# the default exit layers of the 30-layer deployment the soak creates without naming any
LAYERS = default_exit_layers(30)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))] * 1000, 2) if values else 0.0


async def poller(http, name, token, index, stop_at, stats):
    headers = {"Authorization": f"Bearer {token}"}
    etag = None
    while time.monotonic() < stop_at:
        started = time.perf_counter()
        try:
            response = await http.get(f"/v1/deployments/{name}/thresholds",
                                      params={"runtime_id": f"rt-{index}"},
                                      headers={**headers, **({"If-None-Match": etag}
                                                             if etag else {})})
            stats["poll_latency"].append(time.perf_counter() - started)
            stats["poll_status"][response.status_code] += 1
            if response.status_code == 200:
                etag = response.headers["etag"]
        except httpx.HTTPError as error:
            stats["poll_status"][type(error).__name__] += 1
        await asyncio.sleep(1.0)


async def sender(http, name, token, index, rate, stop_at, stats):
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/msgpack"}
    batch_size = max(1, int(rate / 10))
    seq = 0
    while time.monotonic() < stop_at:
        tick = time.monotonic()
        now = time.time()
        records = [{"threshold_version": 1, "request_id": f"s{index}-{seq}", "position": i,
                    "exit_layer": LAYERS[i % len(LAYERS)], "signal_value": 0.5,
                    "latency_us": 900, "ts": now} for i in range(batch_size)]
        body = msgpack.packb({"batch_id": uuid.uuid4().hex, "deployment": name,
                              "runtime_id": f"sender-{index}", "seq": seq, "num_layers": 30,
                              "records": records})
        seq += 1
        for _attempt in range(20):  # a runtime retries until the batch is acknowledged
            started = time.perf_counter()
            try:
                response = await http.post("/v1/telemetry", content=body, headers=headers)
                stats["ingest_latency"].append(time.perf_counter() - started)
                stats["ingest_status"][response.status_code] += 1
                if response.status_code == 202:
                    stats["sent"] += batch_size
                    break
            except httpx.HTTPError as error:
                stats["ingest_status"][type(error).__name__] += 1
            await asyncio.sleep(0.2)
        await asyncio.sleep(max(0.0, 0.1 - (time.monotonic() - tick)))


async def mover(http, name, auth, stop_at, stats):
    version = 2
    while time.monotonic() < stop_at:
        await asyncio.sleep(30)
        version = 3 if version == 2 else 2
        response = await http.put(f"/v1/deployments/{name}/aliases/active", headers=auth,
                                  json={"version": version, "reason": "soak"})
        stats["moves"][response.status_code] += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--runtimes", type=int, default=100)
    parser.add_argument("--records-per-s", type=float, default=2000)
    parser.add_argument("--senders", type=int, default=4)
    parser.add_argument("--database-url", default="")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="exitplane-soak-"))
    env = {**os.environ, "EXITPLANE_VAR_DIR": str(workdir), "EXITPLANE_LOG_LEVEL": "warning"}
    if args.database_url:
        env["EXITPLANE_DATABASE_URL"] = args.database_url
    exe = str(Path(sys.executable).parent / "exitplane")
    subprocess.run([exe, "db", "upgrade"], env=env, check=True, capture_output=True)
    admin = subprocess.run([exe, "bootstrap", "token", "--name", "soak", "--scope", "admin"],
                           env=env, check=True, capture_output=True, text=True).stdout.strip()
    port = free_port()
    api = subprocess.Popen([exe, "up", "--port", str(port), "--no-migrate", "--no-workers"],
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    stats = {"poll_latency": [], "ingest_latency": [], "poll_status": Counter(),
             "ingest_status": Counter(), "moves": Counter(), "sent": 0}
    try:
        wait_ready(f"{base}/readyz")
        auth = {"Authorization": f"Bearer {admin}"}
        name = "soak"
        httpx.post(f"{base}/v1/deployments", headers=auth, json={
            "name": name, "model_ref": "m", "num_layers": 30}).raise_for_status()
        for value in (0.9, 0.8):
            httpx.post(f"{base}/v1/deployments/{name}/threshold-sets", headers=auth, json={
                "thresholds": {str(k): value for k in LAYERS}, "reason": "soak"}
            ).raise_for_status()
        tokens = [httpx.post(f"{base}/v1/tokens", headers=auth, json={
            "name": f"rt-{i}", "scope": "runtime", "deployment": name}).json()["token"]
            for i in range(args.runtimes)]

        async def run() -> float:
            limits = httpx.Limits(max_connections=args.runtimes + args.senders + 4)
            async with httpx.AsyncClient(base_url=base, timeout=30, limits=limits) as http:
                started = time.monotonic()
                stop_at = started + args.seconds
                await asyncio.gather(
                    *(poller(http, name, tokens[i], i, stop_at, stats)
                      for i in range(args.runtimes)),
                    *(sender(http, name, tokens[i % len(tokens)], i,
                             args.records_per_s / args.senders, stop_at, stats)
                      for i in range(args.senders)),
                    mover(http, name, auth, stop_at, stats))
                return time.monotonic() - started

        elapsed = asyncio.run(run())
        stored = httpx.get(f"{base}/v1/deployments/{name}/telemetry/count",
                           headers={"Authorization": f"Bearer {tokens[0]}"}).json()["records"]
    finally:
        api.terminate()
        api.wait(timeout=30)
    errors = sum(v for k, v in stats["poll_status"].items() if k not in (200, 304)) + sum(
        v for k, v in stats["ingest_status"].items() if k != 202)
    result = {
        "seconds": round(elapsed, 1), "runtimes": args.runtimes,
        "polls": sum(stats["poll_status"].values()),
        "polls_per_s": round(sum(stats["poll_status"].values()) / elapsed, 1),
        "poll_p50_ms": pct(stats["poll_latency"], 0.5),
        "poll_p99_ms": pct(stats["poll_latency"], 0.99),
        "ingest_records_per_s": round(stats["sent"] / elapsed, 1),
        "ingest_p50_ms": pct(stats["ingest_latency"], 0.5),
        "ingest_p99_ms": pct(stats["ingest_latency"], 0.99),
        "errors": errors, "poll_status": {str(k): v for k, v in stats["poll_status"].items()},
        "ingest_status": {str(k): v for k, v in stats["ingest_status"].items()},
        "alias_moves": sum(stats["moves"].values()), "sent": stats["sent"], "stored": stored,
        "stored_equals_sent": stored == stats["sent"],
        "database": "postgresql" if args.database_url.startswith("postgresql") else "sqlite"}
    print(f"command: {Path(sys.executable).name} {' '.join(sys.argv)}")
    for key in ("polls_per_s", "poll_p50_ms", "poll_p99_ms", "ingest_records_per_s",
                "ingest_p50_ms", "ingest_p99_ms", "errors", "sent", "stored"):
        print(f"  {key:<22}{result[key]}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
