"""API CPU per telemetry POST: the pure-ASGI fast path against the FastAPI route.

At fleet scale the API's cost is per request, so this measures CPU-seconds of one API process
per `POST /v1/telemetry`, as a fleet sends them: msgpack aggregate batches (4 cells, one
minute of a runtime at `--tokens-per-batch`) alternating with sampled record batches
(`--records-per-batch` records, a tenth of them shadow tokens), each with its own batch id.
The production path: PostgreSQL (a database of its own), a private Redis (rate limits and the
telemetry stream; no ingest worker, so only the API is measured),
`EXITPLANE_ENVIRONMENT=production`, the default 2 s token cache.

API processes: `fast` (this tree), `route` (this tree, `EXITPLANE_TELEMETRY_FAST_PATH=false`)
and, with `--baseline-tree DIR` (e.g. `git archive main | tar -x -C DIR`), `baseline`: that
tree's code on PYTHONPATH. Four workloads: `hot` (`--hot-tokens` tokens in turn: the token
cache hits), `fleet` (`--requests` tokens, each used once per round and rounds more than the
cache's 2 s apart, as a fleet whose runtimes post every 5 s meets: no hit within the maximum
age), `interval` (as `fleet`, but each request one interval batch carrying what a pair of
`fleet`'s requests carries: the aggregate cells and the records as columns; not for a
baseline tree that predates interval batches) and `beat` (heartbeats from the fleet's tokens,
one runtime id each: an upsert each). `ratio_interval_to_pair`: API CPU per runtime interval,
one interval batch against an aggregate batch plus a record batch (2 x `fleet`).
Rounds are interleaved so the load other processes put on this machine falls on every process
alike; CPU comes from /proc for the API process and its children. Prints the command, a
table, then one JSON line (microseconds of API CPU per request, medians over rounds, and
ratios to the route and to the baseline).

    . var/services/env  # EXITPLANE_BENCH_POSTGRES_URL
    rm -rf /tmp/ep-base && mkdir /tmp/ep-base && git archive main | tar -x -C /tmp/ep-base
    .venv/bin/python bench/telemetry_post.py --requests 1000 --rounds 5 \
        --baseline-tree /tmp/ep-base
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
from controlplane.deployments.service import get_deployment  # noqa: E402
from exitplane.client.aggregate import Aggregator  # noqa: E402
from exitplane.client.codec import encode_aggregate, encode_interval  # noqa: E402
from exitplane.wire import (  # noqa: E402
    AGGREGATE_MSGPACK,
    HISTOGRAM_BINS,
    INTERVAL_MSGPACK,
    RECORDS_MSGPACK,
    AggregateBatch,
    RecordColumns,
    TokenRecord,
)

DEPLOYMENT = "tpost"
TOKEN_CACHE_TTL_S = 2.0  # the settings' default, which the processes keep


def aggregate_body(seq: int, tokens: int, runtime_id: str) -> bytes:
    """One runtime's aggregate batch, cut by the real client's aggregator: one minute,
    version 1, the exit mix of bench/fleet.py."""
    aggregator = Aggregator(exit_layers=EXIT_LAYERS, num_layers=NUM_LAYERS)
    exits = [int(tokens * share) for share in NORMAL_MIX]
    histogram = [[count // HISTOGRAM_BINS] * HISTOGRAM_BINS for count in exits]
    aggregator.add_counts(minute=int(time.time()) // 60 * 60, threshold_version=1, exits=exits,
                          histogram=histogram)
    return encode_aggregate(deployment=DEPLOYMENT, runtime_id=runtime_id, seq=seq,
                            num_layers=NUM_LAYERS, raw_sample_rate=0.01,
                            cells=aggregator.cut()).body


def records_body(seq: int, count: int, runtime_id: str) -> bytes:
    """One runtime's sampled records batch, a tenth of them shadow tokens."""
    return msgpack.packb({"batch_id": uuid.uuid4().hex, "deployment": DEPLOYMENT,
                          "runtime_id": runtime_id, "seq": seq, "num_layers": NUM_LAYERS,
                          "records": _records(seq, count), "aggregated": True},
                         use_bin_type=True)


def interval_body(seq: int, tokens: int, count: int, runtime_id: str) -> bytes:
    """What `aggregate_body` and `records_body` carry, as one interval batch."""
    cells = AggregateBatch.model_validate(
        msgpack.unpackb(aggregate_body(seq, tokens, runtime_id))).cells
    records = [TokenRecord.model_validate(record) for record in _records(seq, count)]
    return encode_interval(deployment=DEPLOYMENT, runtime_id=runtime_id, seq=seq,
                           num_layers=NUM_LAYERS, raw_sample_rate=0.01, cells=cells,
                           records=RecordColumns.of(records)).body


def _records(seq: int, count: int) -> list[dict]:
    now = time.time()
    records = []
    for k in range(count):
        shadow = k % 10 == 0
        records.append({"threshold_version": 1, "request_id": f"req-{seq}-{k // 20}",
                        "position": k, "exit_layer": NUM_LAYERS if shadow else EXIT_LAYERS[k % 3],
                        "signal_value": 0.5, "latency_us": 1000, "ts": now,
                        "shadow": [{"layer": layer, "signal": 0.4, "matched": True}
                                   for layer in EXIT_LAYERS] if shadow else None})
    return records


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


async def post_all(url: str, requests: list[tuple[str, str, str, bytes]], concurrency: int
                   ) -> dict[int, int]:
    """POST every (path, token, content type, body) with `concurrency` keep-alive
    connections."""
    statuses: dict[int, int] = {}
    queue = list(reversed(requests))

    async def connection() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            while queue:
                path, token, content_type, body = queue.pop()
                response = await http.post(path, content=body, headers={
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
    parser.add_argument("--hot-tokens", type=int, default=8,
                        help="runtime tokens of the hot workload, in turn")
    parser.add_argument("--baseline-tree", default="",
                        help="a checkout of the code to compare with (its own process)")
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
        admin_token = subprocess.run([EXE, "bootstrap", "token", "--name", "bench", "--scope",
                                      "admin"], env=env, check=True, capture_output=True,
                                     text=True).stdout.strip()
        urls = {}
        servers = {"fast": {"EXITPLANE_TELEMETRY_FAST_PATH": "true"},
                   "route": {"EXITPLANE_TELEMETRY_FAST_PATH": "false"}}
        trees = dict.fromkeys(servers, ROOT)
        if args.baseline_tree:
            tree = Path(args.baseline_tree).resolve()
            # the tree's own client (wire schema) too, ahead of this tree's
            client = tree / "clients" / "python" / "src"
            servers["baseline"] = {"PYTHONPATH": os.pathsep.join(
                [str(tree), *([str(client)] if client.is_dir() else []),
                 *filter(None, [os.environ.get("PYTHONPATH")])])}
            trees["baseline"] = tree
        for name, own in servers.items():
            port = _free_port()
            with (workdir / f"{name}.log").open("w") as log:
                processes[name] = subprocess.Popen(
                    [EXE, "up", "--host", "127.0.0.1", "--port", str(port), "--no-migrate",
                     "--no-workers"], env={**env, **own}, cwd=trees[name],
                    stdout=log, stderr=subprocess.STDOUT)
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
            made = {workload: [create_token(session=session, name=f"tpost-{workload}-{i}",
                                            scope="runtime", deployment=target)[1]
                               for i in range(count)]
                    for workload, count in (("hot", args.hot_tokens),
                                            ("fleet", args.requests))}
            session.commit()

        def requests(workload: str, count: int) -> list[tuple[str, str, str, bytes]]:
            tokens = made["hot" if workload == "hot" else "fleet"]
            out = []
            for i in range(count):
                token = tokens[i % len(tokens)]
                # a runtime id belongs to the token that registered it: one id per token
                runtime_id = f"rt-{'hot-' if workload == 'hot' else ''}{i % len(tokens)}"
                if workload == "beat":
                    out.append((f"/v1/deployments/{DEPLOYMENT}/heartbeats", token,
                                "application/json", json.dumps({
                                    "runtime_id": runtime_id, "applied_version": 1,
                                    "applied_checksum": "0" * 64}).encode()))
                elif workload == "interval":
                    out.append(("/v1/telemetry", token, INTERVAL_MSGPACK, interval_body(
                        i, args.tokens_per_batch, args.records_per_batch, runtime_id)))
                elif i % 2 == 0:
                    out.append(("/v1/telemetry", token, AGGREGATE_MSGPACK,
                                aggregate_body(i, args.tokens_per_batch, runtime_id)))
                else:
                    out.append(("/v1/telemetry", token, RECORDS_MSGPACK,
                                records_body(i, args.records_per_batch, runtime_id)))
            return out

        for name in urls:  # warm-up: imports, caches, connections
            statuses = asyncio.run(post_all(urls[name], requests("hot", 50), args.concurrency))
            if set(statuses) != {202}:
                raise RuntimeError(f"{name} answered {statuses} (logs in {workdir})")
        per_request: dict[str, list[float]] = {
            f"{name}_{workload}": [] for workload in ("hot", "fleet", "interval", "beat")
            for name in urls if (name, workload) != ("baseline", "interval")}
        fleet_done: dict[str, float] = {}
        for _ in range(args.rounds):
            for key in per_request:
                name, workload = key.rsplit("_", 1)
                batch = requests(workload, args.requests)  # built before the meter starts
                if workload != "hot":  # no token of this round is still in the cache
                    time.sleep(max(0.0, fleet_done.get(name, 0.0) + TOKEN_CACHE_TTL_S + 0.2
                                   - time.monotonic()))
                before = tree_cpu(processes[name].pid)
                statuses = asyncio.run(post_all(urls[name], batch, args.concurrency))
                spent = tree_cpu(processes[name].pid) - before
                fleet_done[name] = time.monotonic()
                if set(statuses) != {200 if workload == "beat" else 202}:
                    raise RuntimeError(f"{name} answered {statuses} (logs in {workdir})")
                per_request[key].append(spent / args.requests * 1e6)
        if args.py_spy:
            # py-spy comes with the dev extra (a layered venv may hold it in its base's bin).
            found = shutil.which("py-spy", path=os.pathsep.join(
                [str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
            spy = subprocess.Popen([found or "py-spy", "record",
                                    "--pid", str(processes[args.py_spy].pid), "--format", "raw",
                                    "--rate", "250", "--nonblocking", "-o", args.py_spy_out],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
            asyncio.run(post_all(urls[args.py_spy], requests("fleet", args.requests),
                                 args.concurrency))
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

    median = {key: statistics.median(values) for key, values in per_request.items()}
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"{'process_workload':<18}{'us CPU/request (median)':>25}   rounds")
    for key, values in per_request.items():
        print(f"{key:<18}{median[key]:>25.0f}   {' '.join(f'{v:.0f}' for v in values)}")
    ratios = {}
    ratios["ratio_interval_to_pair"] = round(
        median["fast_interval"] / (2 * median["fast_fleet"]), 3)
    for workload in ("hot", "fleet", "interval", "beat"):
        ratios[f"ratio_fast_to_route_{workload}"] = round(
            median[f"fast_{workload}"] / median[f"route_{workload}"], 3)
        if f"baseline_{workload}" in median:
            ratios[f"ratio_fast_to_baseline_{workload}"] = round(
                median[f"fast_{workload}"] / median[f"baseline_{workload}"], 3)
    print(json.dumps({
        "requests_per_round": args.requests, "rounds": args.rounds,
        "concurrency": args.concurrency, "hot_tokens": args.hot_tokens,
        **{f"us_per_request_{key}": round(value, 1) for key, value in median.items()},
        **ratios, "load_1min": round(os.getloadavg()[0], 2)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
