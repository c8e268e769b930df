"""API CPU per telemetry POST (issue 14): the pure-ASGI fast path against the FastAPI route.

At fleet scale the API's cost is per request, so this measures CPU-seconds of one API process
per `POST /v1/telemetry`, as a fleet sends them: msgpack aggregate batches (4 cells, one
minute of a runtime at `--tokens-per-batch`) alternating with sampled record batches
(`--records-per-batch` records, a tenth of them shadow tokens), each with its own batch id,
from `--tokens` runtime tokens in turn. The production path: PostgreSQL (a database of its
own), a private Redis (rate limits and the telemetry stream; no ingest worker, so only the
API is measured), `EXITPLANE_ENVIRONMENT=production`.

Four API processes: {fast path, route} x {token cache as configured (2 s: a token used again
within it is a cache hit), `EXITPLANE_TOKEN_CACHE_TTL_S=0` (a store lookup per request, as a
fleet runtime whose requests are 5 s apart meets)}. Rounds are interleaved (each process gets
`--requests` per round, in turn) so the load other processes put on this machine falls on all
four alike; CPU comes from /proc for the API process and its children. Prints the command, a
table, then one JSON line (microseconds of API CPU per request, medians over rounds, and the
ratios fast/route).

    . var/services/env  # EXITPLANE_BENCH_POSTGRES_URL
    .venv/bin/python bench/telemetry_post.py --requests 1000 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import msgpack
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.fleet import (  # noqa: E402
    EXE,
    EXIT_LAYERS,
    NORMAL_MIX,
    NUM_LAYERS,
    _free_port,
    _proc_cpu,
)
from controlplane.auth.service import create_token  # noqa: E402
from controlplane.db import make_engine  # noqa: E402
from controlplane.thresholds.service import get_deployment  # noqa: E402
from exitplane.client.aggregate import Aggregator  # noqa: E402
from exitplane.client.codec import encode_aggregate  # noqa: E402
from exitplane.wire import AGGREGATE_MSGPACK, HISTOGRAM_BINS, RECORDS_MSGPACK  # noqa: E402

DEPLOYMENT = "tpost"
SERVERS = [("fast", True, None), ("route", False, None),
           ("fast_lookup", True, "0"), ("route_lookup", False, "0")]


def aggregate_body(seq: int, tokens: int) -> bytes:
    """One runtime's aggregate batch, cut by the real client's aggregator: one minute,
    version 1, the exit mix of bench/fleet.py."""
    aggregator = Aggregator(exit_layers=EXIT_LAYERS, num_layers=NUM_LAYERS)
    exits = [int(tokens * share) for share in NORMAL_MIX]
    histogram = [[count // HISTOGRAM_BINS] * HISTOGRAM_BINS for count in exits]
    aggregator.add_counts(minute=int(time.time()) // 60 * 60, threshold_version=1, exits=exits,
                          histogram=histogram)
    return encode_aggregate(deployment=DEPLOYMENT, runtime_id=f"rt-{seq % 97}", seq=seq,
                            num_layers=NUM_LAYERS, raw_sample_rate=0.01,
                            cells=aggregator.cut()).body


def records_body(seq: int, count: int) -> bytes:
    """One runtime's sampled records batch, a tenth of them shadow tokens."""
    now = time.time()
    records = []
    for k in range(count):
        shadow = k % 10 == 0
        records.append({"threshold_version": 1, "request_id": f"req-{seq}-{k // 20}",
                        "position": k, "exit_layer": NUM_LAYERS if shadow else EXIT_LAYERS[k % 3],
                        "signal_value": 0.5, "latency_us": 1000, "ts": now,
                        "shadow": [{"layer": layer, "signal": 0.4, "matched": True}
                                   for layer in EXIT_LAYERS] if shadow else None})
    return msgpack.packb({"batch_id": uuid.uuid4().hex, "deployment": DEPLOYMENT,
                          "runtime_id": f"rt-{seq % 97}", "seq": seq, "num_layers": NUM_LAYERS,
                          "records": records, "aggregated": True}, use_bin_type=True)


def tree_cpu(pid: int) -> float:
    """CPU-seconds of `pid` and its descendants so far."""
    procs = _proc_cpu()
    children: dict[int, list[int]] = {}
    for child, (parent, _) in procs.items():
        children.setdefault(parent, []).append(child)
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        total += procs.get(current, (0, 0.0))[1]
        todo.extend(children.get(current, ()))
    return total


async def post_all(url: str, requests: list[tuple[str, str, bytes]], concurrency: int
                   ) -> dict[int, int]:
    """POST every (token, content type, body) with `concurrency` keep-alive connections."""
    statuses: dict[int, int] = {}
    queue = list(reversed(requests))

    async def connection() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            while queue:
                token, content_type, body = queue.pop()
                response = await http.post("/v1/telemetry", content=body, headers={
                    "Authorization": f"Bearer {token}", "Content-Type": content_type})
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

    await asyncio.gather(*(connection() for _ in range(concurrency)))
    return statuses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--postgres-url", default=os.environ.get("EXITPLANE_BENCH_POSTGRES_URL"))
    parser.add_argument("--requests", type=int, default=1000, help="per process and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8, help="runtime tokens, in turn")
    parser.add_argument("--tokens-per-batch", type=int, default=5000)
    parser.add_argument("--records-per-batch", type=int, default=100)
    parser.add_argument("--py-spy", default="", metavar="PROCESS",
                        help="after the rounds, profile one more round of PROCESS (fast, "
                             "route, ...) with py-spy; collapsed stacks to --py-spy-out")
    parser.add_argument("--py-spy-out", default="telemetry_post.folded")
    args = parser.parse_args()
    if not args.postgres_url:
        parser.error("give --postgres-url or set EXITPLANE_BENCH_POSTGRES_URL "
                     "(. var/services/env)")

    workdir = Path(tempfile.mkdtemp(prefix="exitplane-tpost-"))
    base = make_url(args.postgres_url)
    db_name = f"exitplane_tpost_{os.getpid()}"
    admin = make_engine(base.set(database="postgres").render_as_string(hide_password=False))
    with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        connection.execute(text(f'CREATE DATABASE "{db_name}"'))
    db_url = base.set(database=db_name).render_as_string(hide_password=False)
    redis_port = _free_port()
    processes: dict[str, subprocess.Popen] = {}
    engine = None
    try:
        processes["redis"] = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(redis_port),
             "--bind", "127.0.0.1", "--save", "", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        env = {**os.environ, "EXITPLANE_DATABASE_URL": db_url,
               "EXITPLANE_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
               "EXITPLANE_ENVIRONMENT": "production", "EXITPLANE_LOG_LEVEL": "warning",
               "EXITPLANE_SECRET_KEY": uuid.uuid4().hex + uuid.uuid4().hex,
               "EXITPLANE_VAR_DIR": str(workdir / "var")}
        subprocess.run([EXE, "db", "upgrade"], env=env, check=True, capture_output=True)
        engine = make_engine(db_url)
        admin_token = subprocess.run([EXE, "token", "create", "--name", "bench", "--scope",
                                      "admin"], env=env, check=True, capture_output=True,
                                     text=True).stdout.strip()
        urls = {}
        for name, fast, ttl in SERVERS:
            port = _free_port()
            own = {**env, "EXITPLANE_TELEMETRY_FAST_PATH": str(fast).lower()}
            if ttl is not None:
                own["EXITPLANE_TOKEN_CACHE_TTL_S"] = ttl
            with (workdir / f"{name}.log").open("w") as log:
                processes[name] = subprocess.Popen(
                    [EXE, "up", "--host", "127.0.0.1", "--port", str(port), "--no-migrate",
                     "--no-workers"], env=own, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            urls[name] = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        for name, url in urls.items():
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not become ready (logs in {workdir})")
                time.sleep(0.2)
        auth = {"Authorization": f"Bearer {admin_token}"}
        first = urls["fast"]
        httpx.post(f"{first}/v1/deployments", headers=auth, timeout=30, json={
            "name": DEPLOYMENT, "model_ref": "bench", "num_layers": NUM_LAYERS,
            "exit_layers": EXIT_LAYERS}).raise_for_status()
        httpx.post(f"{first}/v1/deployments/{DEPLOYMENT}/threshold-sets", headers=auth,
                   timeout=30, json={"thresholds": {str(k): 0.9 for k in EXIT_LAYERS},
                                     "reason": "bench", "activate": True}).raise_for_status()
        with Session(engine) as session:
            target = get_deployment(session=session, name=DEPLOYMENT)
            tokens = [create_token(session=session, name=f"tpost-{i}", scope="runtime",
                                   deployment=target)[1] for i in range(args.tokens)]
            session.commit()

        def requests(count: int) -> list[tuple[str, str, bytes]]:
            out = []
            for i in range(count):
                token = tokens[i % len(tokens)]
                if i % 2 == 0:
                    out.append((token, AGGREGATE_MSGPACK,
                                aggregate_body(i, args.tokens_per_batch)))
                else:
                    out.append((token, RECORDS_MSGPACK,
                                records_body(i, args.records_per_batch)))
            return out

        for name in urls:  # warm-up: imports, caches, connections
            statuses = asyncio.run(post_all(urls[name], requests(50), args.concurrency))
            if set(statuses) != {202}:
                raise RuntimeError(f"{name} answered {statuses} (logs in {workdir})")
        per_request: dict[str, list[float]] = {name: [] for name in urls}
        for _ in range(args.rounds):
            for name in urls:
                batch = requests(args.requests)  # built before the meter starts
                before = tree_cpu(processes[name].pid)
                statuses = asyncio.run(post_all(urls[name], batch, args.concurrency))
                spent = tree_cpu(processes[name].pid) - before
                if set(statuses) != {202}:
                    raise RuntimeError(f"{name} answered {statuses} (logs in {workdir})")
                per_request[name].append(spent / args.requests * 1e6)
        if args.py_spy:
            # py-spy comes with the dev extra (a layered venv may hold it in its base's bin).
            found = shutil.which("py-spy", path=os.pathsep.join(
                [str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
            spy = subprocess.Popen([found or "py-spy", "record",
                                    "--pid", str(processes[args.py_spy].pid), "--format", "raw",
                                    "--rate", "250", "--nonblocking", "-o", args.py_spy_out],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
            asyncio.run(post_all(urls[args.py_spy], requests(args.requests), args.concurrency))
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=30)
    finally:
        for name, process in processes.items():
            if name != "redis":
                process.terminate()
        for name, process in processes.items():
            if name != "redis":
                process.wait(timeout=20)
        if "redis" in processes:
            processes["redis"].terminate()
            processes["redis"].wait(timeout=20)
        if engine is not None:
            engine.dispose()
        with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)'))
        admin.dispose()
        shutil.rmtree(workdir, ignore_errors=True)

    median = {name: statistics.median(values) for name, values in per_request.items()}
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"{'API process':<16}{'us CPU/request (median)':>26}{'rounds':>40}")
    for name, values in per_request.items():
        print(f"{name:<16}{median[name]:>26.0f}    {' '.join(f'{v:.0f}' for v in values)}")
    print(json.dumps({
        "requests_per_round": args.requests, "rounds": args.rounds,
        "concurrency": args.concurrency, "tokens": args.tokens,
        **{f"us_per_request_{name}": round(value, 1) for name, value in median.items()},
        "ratio_fast_to_route": round(median["fast"] / median["route"], 3),
        "ratio_fast_to_route_lookup": round(median["fast_lookup"] / median["route_lookup"], 3),
        "load_1min": round(os.getloadavg()[0], 2)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
