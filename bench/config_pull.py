"""Config-pull benchmark: N concurrent runtimes polling thresholds with If-None-Match.

Starts the control plane API (`exitplane up --no-workers`: only the API is measured) and, as
the ceiling, a trivial FastAPI app, each as its own uvicorn process; with `--baseline-tree DIR`
(a checkout of other code, e.g. `git worktree add DIR <commit>`) also that tree's API, with
its own database, in the same run. Each is driven by the same lean keep-alive HTTP/1.1
client, `--rounds` times in an order that rotates each round, so that the load other
processes put on this machine falls on every server alike. Figures are medians over rounds
and each ratio is the median of the rounds' ratios (each round's servers ran minutes apart at
most). CPU per request is the API process's CPU time (/proc) over the requests it answered.

Store: SQLite under a temp dir, or with `--database-url` a PostgreSQL server on which the
bench creates a database per API (dropped afterwards); `--redis-url` gives every API that
Redis (notification bus, rate limits). The pull rate limit is lifted (one token stands for
every simulated runtime). Prints the command, a table, then one JSON line.

    .venv/bin/python bench/config_pull.py --clients 64 --seconds 10
    git worktree add /tmp/ep-base <commit>
    .venv/bin/python bench/config_pull.py --baseline-tree /tmp/ep-base
    . var/services/env  # EXITPLANE_BENCH_POSTGRES_URL
    .venv/bin/python bench/config_pull.py --baseline-tree /tmp/ep-base \\
        --database-url "$EXITPLANE_BENCH_POSTGRES_URL" --redis-url redis://127.0.0.1:56379/7
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

try:
    from fastapi import FastAPI
except ImportError:  # pragma: no cover - the bench needs the controlplane extra
    FastAPI = None

ROOT = Path(__file__).resolve().parent.parent
EXIT_LAYERS = list(range(6, 30, 3))
EXE = str(Path(sys.executable).parent / "exitplane")

trivial_app = FastAPI() if FastAPI else None
if trivial_app is not None:

    @trivial_app.get("/ping")
    async def ping() -> dict:
        return {"ok": True}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited with {process.returncode}:\n{log.read_text()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code < 500:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up:\n{log.read_text()}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _connection(port: int, request: bytes, stop_at: float, latencies: list[float],
                      statuses: dict[int, int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.perf_counter() < stop_at:
            started = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            if length:
                await reader.readexactly(length)
            latencies.append(time.perf_counter() - started)
            statuses[status] = statuses.get(status, 0) + 1
    finally:
        writer.close()


def drive(port: int, path: str, headers: dict[str, str], clients: int, seconds: float,
          pid: int | None = None) -> dict:
    """Run `clients` keep-alive connections against `path` for `seconds`."""
    lines = [f"GET {path} HTTP/1.1", "Host: 127.0.0.1"] + [f"{k}: {v}" for k, v in headers.items()]
    request = ("\r\n".join(lines) + "\r\n\r\n").encode()
    latencies: list[float] = []
    statuses: dict[int, int] = {}

    async def main() -> None:
        stop_at = time.perf_counter() + seconds
        await asyncio.gather(*(_connection(port, request, stop_at, latencies, statuses)
                               for _ in range(clients)))

    cpu_before = cpu_seconds(pid) if pid else 0.0
    started = time.perf_counter()
    asyncio.run(main())
    elapsed = time.perf_counter() - started
    cpu = cpu_seconds(pid) - cpu_before if pid else 0.0
    latencies.sort()
    pick = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000  # noqa: E731
    return {"rps": len(latencies) / elapsed, "p50_ms": pick(0.50), "p99_ms": pick(0.99),
            "requests": len(latencies), "statuses": statuses,
            "us_cpu": cpu / max(1, len(latencies)) * 1e6}


@dataclass
class Api:
    """One control plane API under test: its code (`tree`, on PYTHONPATH), store, process and
    the pull it answers."""

    label: str
    tree: Path
    env: dict[str, str]
    log: Path
    port: int = 0
    process: subprocess.Popen | None = None
    path: str = ""
    headers: dict[str, str] = field(default_factory=dict)

    def run(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run([EXE, *args], env=self.env, cwd=self.tree, check=True,
                              capture_output=True, text=True, **kwargs)

    def start(self) -> None:
        self.run("db", "upgrade")
        self.port = free_port()
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                [EXE, "up", "--host", "127.0.0.1", "--port", str(self.port), "--no-migrate",
                 "--no-workers"], env=self.env, cwd=self.tree, stdout=out,
                stderr=subprocess.STDOUT)

    def prepare(self, name: str) -> None:
        """A deployment with an active set and a runtime token; the 304 pull's request."""
        base = f"http://127.0.0.1:{self.port}"
        wait_ready(f"{base}/healthz", self.process, self.log)
        admin = self.run("bootstrap", "token", "--name", "bench", "--scope", "admin").stdout.strip()
        auth = {"Authorization": f"Bearer {admin}"}
        httpx.post(f"{base}/v1/deployments", headers=auth, timeout=30, json={
            "name": name, "model_ref": "smollm2-135m", "num_layers": 30,
            "exit_layers": EXIT_LAYERS}).raise_for_status()  # named: trees differ in defaults
        httpx.post(f"{base}/v1/deployments/{name}/threshold-sets", headers=auth, timeout=30,
                   json={"thresholds": {str(k): 0.9 for k in EXIT_LAYERS},
                         "reason": "bench", "activate": True}).raise_for_status()
        runtime = httpx.post(f"{base}/v1/tokens", headers=auth, timeout=30, json={
            "name": "bench-rt", "scope": "runtime", "deployment": name}).json()["token"]
        self.path = f"/v1/deployments/{name}/thresholds?runtime_id=bench-1"
        self.headers = {"Authorization": f"Bearer {runtime}"}
        pulled = httpx.get(base + self.path, headers=self.headers, timeout=30)
        pulled.raise_for_status()
        self.headers["If-None-Match"] = pulled.headers["etag"]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextlib.contextmanager
def postgres_databases(server_url: str, names: list[str]):
    """Databases `names` created on the PostgreSQL server of `server_url` (dropped on exit);
    yields their URLs."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    base = make_url(server_url)
    admin = create_engine(base.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            for name in names:
                connection.execute(text(f'CREATE DATABASE "{name}"'))
        yield [base.set(database=name).render_as_string(hide_password=False) for name in names]
    finally:
        with admin.connect() as connection:
            for name in names:
                connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0, help="per server and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline-tree", type=Path, default=None, metavar="DIR",
                        help="a checkout of the code to compare with, run as its own API")
    parser.add_argument("--database-url", default="",
                        help="a PostgreSQL server (default: SQLite files under a temp dir)")
    parser.add_argument("--redis-url", default="", help="a Redis every API uses")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.seconds <= 0 or args.rounds < 1:
        parser.error("--clients, --seconds and --rounds must be positive")
    if args.baseline_tree is not None:
        args.baseline_tree = args.baseline_tree.resolve()
        if not (args.baseline_tree / "controlplane" / "settings.py").is_file():
            parser.error(f"--baseline-tree {args.baseline_tree} is not a checkout of this "
                         "project (no controlplane/settings.py)")
    if args.database_url and not args.database_url.startswith("postgresql"):
        parser.error("--database-url must name a PostgreSQL server (postgresql+psycopg://...)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="exitplane-bench-"))
    trees = {"this": ROOT}  # the tree this script is in, whatever the environment installs
    if args.baseline_tree is not None:
        trees["baseline"] = args.baseline_tree
    common = {**os.environ, "EXITPLANE_LOG_LEVEL": "warning",
              "EXITPLANE_RATE_LIMIT_PULL_PER_S": "0"}
    common.pop("EXITPLANE_DATABASE_URL", None)
    if args.redis_url:
        common["EXITPLANE_REDIS_URL"] = args.redis_url
    apis: dict[str, Api] = {}
    for label, tree in trees.items():
        env = {**common, "EXITPLANE_VAR_DIR": str(workdir / label),
               "PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [
                   os.environ.get("PYTHONPATH")])])}
        apis[label] = Api(label=label, tree=tree, env=env, log=workdir / f"{label}.log")
    db_names = [f"exitplane_pull_{label}_{os.getpid()}" for label in apis]
    ceiling_port = free_port()
    ceiling_log = workdir / "ceiling.log"
    ceiling = None
    try:
        with contextlib.ExitStack() as stack:
            if args.database_url:
                urls = stack.enter_context(postgres_databases(args.database_url, db_names))
                for api, url in zip(apis.values(), urls, strict=True):
                    api.env["EXITPLANE_DATABASE_URL"] = url
            stack.callback(lambda: [api.stop() for api in apis.values()])
            for api in apis.values():
                api.start()
            with ceiling_log.open("w") as out:
                ceiling = subprocess.Popen(
                    [sys.executable, "-m", "uvicorn", "config_pull:trivial_app", "--app-dir",
                     str(Path(__file__).parent), "--port", str(ceiling_port), "--log-level",
                     "warning", "--no-access-log"], env=common, stdout=out,
                    stderr=subprocess.STDOUT)
            stack.callback(ceiling.wait, timeout=20)
            stack.callback(ceiling.terminate)
            wait_ready(f"http://127.0.0.1:{ceiling_port}/ping", ceiling, ceiling_log)
            name = f"bench-{int(time.time())}"
            for api in apis.values():
                api.prepare(name)
                drive(api.port, api.path, api.headers, args.clients, 1.0)  # warm-up
            drive(ceiling_port, "/ping", {}, args.clients, 1.0)
            runs = measure(args, apis, ceiling_port, ceiling.pid)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report(args, runs)
    return 0


def measure(args, apis: dict[str, Api], ceiling_port: int, ceiling_pid: int) -> dict:
    """Every server's 304 runs (rotating order per round), then each API's 200 path."""
    targets = ["ceiling", *apis]
    runs: dict[str, list[dict]] = {target: [] for target in targets}
    for round_number in range(args.rounds):
        shift = round_number % len(targets)
        for target in targets[shift:] + targets[:shift]:
            if target == "ceiling":
                run = drive(ceiling_port, "/ping", {}, args.clients, args.seconds, ceiling_pid)
            else:
                api = apis[target]
                run = drive(api.port, api.path, api.headers, args.clients, args.seconds,
                            api.process.pid)
                if set(run["statuses"]) != {304}:
                    raise RuntimeError(f"{target} answered {run['statuses']} to the 304 pull")
            runs[target].append(run)
    for label, api in apis.items():
        headers = {k: v for k, v in api.headers.items() if k != "If-None-Match"}
        run = drive(api.port, api.path, headers, args.clients, args.seconds, api.process.pid)
        if set(run["statuses"]) != {200}:
            raise RuntimeError(f"{label} answered {run['statuses']} to the full pull")
        runs[f"{label}_200"] = [run]
    return runs


def report(args, runs: dict[str, list[dict]]) -> None:
    def median(target: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[target])

    def ratio(top: str, bottom: str) -> float:
        return round(statistics.median(a["rps"] / b["rps"] for a, b in zip(
            runs[top], runs[bottom], strict=True)), 3)

    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"{'path':<24}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'us CPU':>9}   "
          "req/s per round / p50 ms per round")
    labels = {"ceiling": "ceiling (trivial)", "this": "304 not modified",
              "baseline": "304 baseline tree", "this_200": "200 full set",
              "baseline_200": "200 baseline tree"}
    for target, label in labels.items():
        if target in runs:
            print(f"{label:<24}{median(target, 'rps'):>9.0f}{median(target, 'p50_ms'):>9.2f}"
                  f"{median(target, 'p99_ms'):>9.2f}{median(target, 'us_cpu'):>9.0f}   "
                  + " ".join(f"{run['rps']:.0f}" for run in runs[target]) + " / "
                  + " ".join(f"{run['p50_ms']:.2f}" for run in runs[target]))
    summary = {
        "clients": args.clients, "seconds": args.seconds, "rounds": args.rounds,
        "rps_304": round(median("this", "rps"), 1),
        "p50_ms_304": round(median("this", "p50_ms"), 2),
        "p50_ms_304_rounds": [round(run["p50_ms"], 2) for run in runs["this"]],
        "p99_ms_304": round(median("this", "p99_ms"), 2),
        "us_cpu_304": round(median("this", "us_cpu"), 1),
        "rps_200": round(median("this_200", "rps"), 1),
        "p50_ms_200": round(median("this_200", "p50_ms"), 2),
        "p99_ms_200": round(median("this_200", "p99_ms"), 2),
        "rps_ceiling": round(median("ceiling", "rps"), 1),
        "p99_ms_ceiling": round(median("ceiling", "p99_ms"), 2),
        "ratio_304_to_ceiling": ratio("this", "ceiling"),
    }
    if "baseline" in runs:
        summary.update({
            "rps_304_baseline": round(median("baseline", "rps"), 1),
            "p50_ms_304_baseline": round(median("baseline", "p50_ms"), 2),
            "p50_ms_304_baseline_rounds": [round(run["p50_ms"], 2) for run in runs["baseline"]],
            "p99_ms_304_baseline": round(median("baseline", "p99_ms"), 2),
            "us_cpu_304_baseline": round(median("baseline", "us_cpu"), 1),
            "rps_200_baseline": round(median("baseline_200", "rps"), 1),
            "ratio_304_to_ceiling_baseline": ratio("baseline", "ceiling"),
            "ratio_to_baseline": ratio("this", "baseline"),
            "baseline_tree": str(args.baseline_tree),
        })
    summary.update({"database": "postgresql" if args.database_url else "sqlite",
                    "redis": bool(args.redis_url), "load_1min": round(os.getloadavg()[0], 2)})
    print(json.dumps(summary))


if __name__ == "__main__":
    raise SystemExit(main())
