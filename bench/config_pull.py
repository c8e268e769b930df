"""Config-pull benchmark: N concurrent runtimes polling thresholds with If-None-Match.

Starts the control plane (`exitplane up`, SQLite under a temp dir unless --database-url) and,
as the ceiling, a trivial FastAPI app, each as its own uvicorn process; then drives each with
the same lean keep-alive HTTP/1.1 client. Prints requests/s and p50/p99 for the 304 path, the
200 path and the ceiling; the last line is one JSON object.

    .venv/bin/python bench/config_pull.py --clients 64 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

try:
    from fastapi import FastAPI
except ImportError:  # pragma: no cover - the bench needs the controlplane extra
    FastAPI = None

trivial_app = FastAPI() if FastAPI else None
if trivial_app is not None:

    @trivial_app.get("/ping")
    async def ping() -> dict:
        return {"ok": True}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


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


def drive(port: int, path: str, headers: dict[str, str], clients: int,
          seconds: float) -> dict:
    """Run `clients` keep-alive connections against `path` for `seconds`."""
    lines = [f"GET {path} HTTP/1.1", "Host: 127.0.0.1"] + [f"{k}: {v}" for k, v in headers.items()]
    request = ("\r\n".join(lines) + "\r\n\r\n").encode()
    latencies: list[float] = []
    statuses: dict[int, int] = {}

    async def main() -> None:
        stop_at = time.perf_counter() + seconds
        await asyncio.gather(*(_connection(port, request, stop_at, latencies, statuses)
                               for _ in range(clients)))

    started = time.perf_counter()
    asyncio.run(main())
    elapsed = time.perf_counter() - started
    latencies.sort()
    pick = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000  # noqa: E731
    return {"rps": len(latencies) / elapsed, "p50_ms": pick(0.50), "p99_ms": pick(0.99),
            "requests": len(latencies), "statuses": statuses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--database-url", default="")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="exitplane-bench-"))
    # One token stands for all 64 simulated runtimes here, so its rate limit is lifted.
    env = {**os.environ, "EXITPLANE_VAR_DIR": str(workdir), "EXITPLANE_LOG_LEVEL": "warning",
           "EXITPLANE_RATE_LIMIT_PULL_PER_S": "0"}
    if args.database_url:
        env["EXITPLANE_DATABASE_URL"] = args.database_url
    exe = str(Path(sys.executable).parent / "exitplane")
    subprocess.run([exe, "db", "upgrade"], env=env, check=True, capture_output=True)
    admin = subprocess.run([exe, "token", "create", "--name", "bench", "--scope", "admin"],
                           env=env, check=True, capture_output=True, text=True).stdout.strip()

    api_port, ceiling_port = free_port(), free_port()
    api = subprocess.Popen([exe, "up", "--port", str(api_port), "--no-migrate"], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ceiling = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "config_pull:trivial_app", "--app-dir",
         str(Path(__file__).parent), "--port", str(ceiling_port), "--log-level", "warning",
         "--no-access-log"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{api_port}"
        wait_ready(f"{base}/healthz")
        wait_ready(f"http://127.0.0.1:{ceiling_port}/ping")
        auth = {"Authorization": f"Bearer {admin}"}
        name = f"bench-{int(time.time())}"
        httpx.post(f"{base}/v1/deployments", headers=auth, timeout=30, json={
            "name": name, "model_ref": "smollm2-135m", "num_layers": 30}).raise_for_status()
        layers = range(6, 30, 3)
        httpx.post(f"{base}/v1/deployments/{name}/threshold-sets", headers=auth, timeout=30,
                   json={"thresholds": {str(k): 0.9 for k in layers}, "reason": "bench",
                         "activate": True}).raise_for_status()
        runtime = httpx.post(f"{base}/v1/tokens", headers=auth, timeout=30, json={
            "name": "bench-rt", "scope": "runtime", "deployment": name}).json()["token"]
        path = f"/v1/deployments/{name}/thresholds?runtime_id=bench-1"
        rt_auth = {"Authorization": f"Bearer {runtime}"}
        etag = httpx.get(base + path, headers=rt_auth).headers["etag"]

        drive(api_port, path, {**rt_auth, "If-None-Match": etag}, args.clients, 1.0)  # warm-up
        ceiling_run = drive(ceiling_port, "/ping", {}, args.clients, args.seconds)
        not_modified = drive(api_port, path, {**rt_auth, "If-None-Match": etag}, args.clients,
                             args.seconds)
        full = drive(api_port, path, rt_auth, args.clients, args.seconds)
    finally:
        for process in (api, ceiling):
            process.terminate()
            process.wait(timeout=10)

    assert set(not_modified["statuses"]) == {304}, not_modified["statuses"]
    assert set(full["statuses"]) == {200}, full["statuses"]
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"{'path':<22}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'requests':>10}")
    for label, run in (("ceiling (trivial)", ceiling_run), ("304 not modified", not_modified),
                       ("200 full set", full)):
        print(f"{label:<22}{run['rps']:>10.0f}{run['p50_ms']:>10.2f}{run['p99_ms']:>10.2f}"
              f"{run['requests']:>10}")
    print(f"304 path at {not_modified['rps'] / ceiling_run['rps']:.0%} of the ceiling")
    print(json.dumps({
        "clients": args.clients, "seconds": args.seconds,
        "rps_304": round(not_modified["rps"], 1), "p50_ms_304": round(not_modified["p50_ms"], 2),
        "p99_ms_304": round(not_modified["p99_ms"], 2),
        "rps_200": round(full["rps"], 1), "p50_ms_200": round(full["p50_ms"], 2),
        "p99_ms_200": round(full["p99_ms"], 2),
        "rps_ceiling": round(ceiling_run["rps"], 1),
        "p99_ms_ceiling": round(ceiling_run["p99_ms"], 2),
        "ratio_304_to_ceiling": round(not_modified["rps"] / ceiling_run["rps"], 3),
        "database": "postgresql" if args.database_url.startswith("postgresql") else "sqlite",
    }))


if __name__ == "__main__":
    main()
