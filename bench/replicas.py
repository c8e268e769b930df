"""Replica benchmark: what sharing state through Redis costs and how fast notices travel.

Starts a private redis-server, a fresh PostgreSQL database (from --postgres-url or
EXITPLANE_TEST_POSTGRES_URL) and three API processes (`exitplane up --no-workers`): A and B
with Redis (shared GCRA limit on every pull, set high enough never to refuse), C without a pull
limit. Measures:

- wake_ms: an alias move through B -> a long-poll held on A returns the new set (p50 / p99);
- revoke_ms: a token revoked through A -> B's first 401 while polled every 5 ms;
- rps_304 with the shared limit (A) against no limit (C): the cost of the Redis check on the
  hottest path.

    .venv/bin/python bench/replicas.py --moves 30 --revocations 15 --seconds 5
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from sqlalchemy import text
from sqlalchemy.engine import make_url

sys.path.insert(0, str(Path(__file__).parent))
from config_pull import drive, free_port, wait_ready

from controlplane.db import make_engine
from controlplane.migrate import upgrade

EXE = str(Path(sys.executable).parent / "exitplane")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


def _api(env: dict, **settings: str) -> tuple[subprocess.Popen, str, int]:
    port = free_port()
    process = subprocess.Popen(
        [EXE, "up", "--host", "127.0.0.1", "--port", str(port), "--no-migrate", "--no-workers"],
        env={**env, **{f"EXITPLANE_{k.upper()}": v for k, v in settings.items()}},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    wait_ready(f"{base}/readyz", 90)
    return process, base, port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--postgres-url", default=os.environ.get("EXITPLANE_TEST_POSTGRES_URL"))
    parser.add_argument("--moves", type=int, default=30)
    parser.add_argument("--revocations", type=int, default=15)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    if not args.postgres_url:
        sys.exit("bench/replicas.py needs PostgreSQL: --postgres-url or "
                 "EXITPLANE_TEST_POSTGRES_URL")

    workdir = Path(tempfile.mkdtemp(prefix="exitplane-replicas-"))
    redis_port = free_port()
    redis_server = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(redis_port), "--bind",
         "127.0.0.1", "--dir", str(workdir), "--save", ""], stdout=subprocess.DEVNULL)
    base_url = make_url(args.postgres_url)
    db_name = f"exitplane_bench_replicas_{os.getpid()}"
    admin_engine = make_engine(base_url.set(database="postgres")
                               .render_as_string(hide_password=False))
    with admin_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        connection.execute(text(f'CREATE DATABASE "{db_name}"'))
    database = base_url.set(database=db_name).render_as_string(hide_password=False)
    upgrade(database)
    env = {**os.environ, "EXITPLANE_ENVIRONMENT": "production",
           "EXITPLANE_DATABASE_URL": database, "EXITPLANE_SECRET_KEY": secrets.token_urlsafe(48),
           "EXITPLANE_VAR_DIR": str(workdir / "var"), "EXITPLANE_LOG_LEVEL": "warning",
           "EXITPLANE_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
           # Long caches: only a notice can explain a prompt wake-up or 401.
           "EXITPLANE_CONFIG_CACHE_TTL_S": "30", "EXITPLANE_TOKEN_CACHE_TTL_S": "30"}
    processes = []
    try:
        admin = subprocess.run([EXE, "bootstrap", "token", "--name", "bench", "--scope", "admin"],
                               env=env, check=True, capture_output=True,
                               text=True).stdout.strip()
        a = _api(env, rate_limit_pull_per_s="1000000")
        b = _api(env, rate_limit_pull_per_s="1000000")
        c = _api({**env, "EXITPLANE_REDIS_URL": ""}, rate_limit_pull_per_s="0")
        processes = [a[0], b[0], c[0]]
        auth = {"Authorization": f"Bearer {admin}"}
        httpx.post(f"{a[1]}/v1/deployments", headers=auth, timeout=30, json={
            "name": "chat", "model_ref": "m", "num_layers": 12,
            "exit_layers": [3, 6, 9]}).raise_for_status()
        runtime = httpx.post(f"{a[1]}/v1/tokens", headers=auth, timeout=30, json={
            "name": "rt", "scope": "runtime", "deployment": "chat"}).json()["token"]
        rt_auth = {"Authorization": f"Bearer {runtime}"}
        path = "/v1/deployments/chat/thresholds?runtime_id=bench-1"

        wake_ms = []
        for move in range(args.moves):
            etag = httpx.get(a[1] + path, headers=rt_auth, timeout=30).headers["etag"]
            answer: list[float] = []
            poll = threading.Thread(target=lambda etag=etag, answer=answer: (
                httpx.get(a[1] + path + "&wait=30", timeout=60,
                          headers={**rt_auth, "If-None-Match": etag}),
                answer.append(time.perf_counter())))
            poll.start()
            time.sleep(0.3)  # parked
            moved = time.perf_counter()
            httpx.post(f"{b[1]}/v1/deployments/chat/threshold-sets", headers=auth, timeout=30,
                       json={"thresholds": {"3": 0.5 + move / 1000, "6": 0.9, "9": 0.9},
                             "reason": "bench", "activate": True}).raise_for_status()
            poll.join(timeout=60)
            wake_ms.append((answer[0] - moved) * 1000)

        revoke_ms = []
        for index in range(args.revocations):
            made = httpx.post(f"{a[1]}/v1/tokens", headers=auth, timeout=30, json={
                "name": f"rt-{index}", "scope": "runtime", "deployment": "chat"}).json()
            headers = {"Authorization": f"Bearer {made['token']}"}
            for base in (a[1], b[1]):
                assert httpx.get(base + path, headers=headers, timeout=30).status_code == 200
            revoked = time.perf_counter()
            httpx.delete(f"{a[1]}/v1/tokens/{made['id']}", headers=auth,
                         timeout=30).raise_for_status()
            while httpx.get(b[1] + path, headers=headers, timeout=30).status_code != 401:
                time.sleep(0.005)
            revoke_ms.append((time.perf_counter() - revoked) * 1000)

        etag = httpx.get(a[1] + path, headers=rt_auth, timeout=30).headers["etag"]
        not_modified = {**rt_auth, "If-None-Match": etag}
        drive(a[2], path, not_modified, args.clients, 1.0)  # warm-up
        shared = drive(a[2], path, not_modified, args.clients, args.seconds)
        drive(c[2], path, not_modified, args.clients, 1.0)
        unlimited = drive(c[2], path, not_modified, args.clients, args.seconds)
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=30)
        redis_server.terminate()
        redis_server.wait(timeout=30)
        with admin_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)'))
        admin_engine.dispose()
        shutil.rmtree(workdir, ignore_errors=True)

    assert set(shared["statuses"]) == {304}, shared["statuses"]
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(json.dumps({
        "moves": args.moves, "wake_ms_p50": _percentile(wake_ms, 0.5),
        "wake_ms_p99": _percentile(wake_ms, 0.99), "wake_ms_max": round(max(wake_ms), 2),
        "revocations": args.revocations, "revoke_ms_p50": _percentile(revoke_ms, 0.5),
        "revoke_ms_max": round(max(revoke_ms), 2),
        "clients": args.clients, "rps_304_shared_limit": round(shared["rps"], 1),
        "p99_ms_304_shared_limit": round(shared["p99_ms"], 2),
        "rps_304_no_limit": round(unlimited["rps"], 1),
        "p99_ms_304_no_limit": round(unlimited["p99_ms"], 2)}))


if __name__ == "__main__":
    main()
