"""What one client can make an API process hold: resident memory of a real API process (uvicorn,
SQLite) while one abusive pattern runs, each pattern against a fresh process.

Patterns:
- `unauth_slow_bodies`: 20 connections without a token, each declaring a 16 MiB telemetry body
  and sending 15 MiB of it, then holding the connection open.
- `expanding_batch`: one runtime token posts one 14 MiB msgpack batch of tiny values (lists of
  zeros: one byte each on the wire, an 8-byte pointer or more once decoded).
- `expanding_batch_x8`: the same, 8 at once.
- `keyed_maps_x8`: 8 at once, each a 2 MiB msgpack batch of one-entry maps keyed by new
  strings (the most memory per value decoded).
- `shadow_columns_x8`: 8 at once, each a 14 MiB interval batch whose shadow columns hold
  1.2 million points (no length bound on the wire but the control plane's value budget).
- `shadow_columns_in_budget_x8`: as `shadow_columns_x8` with 240,000 points (2.8 MiB): just
  within the default value budget, so each batch is decoded and validated whole.

Prints the command, then one JSON line per pattern: RSS before, peak during, growth (MiB),
and the answers' status codes. `--tree DIR` runs another checkout's code (e.g. a worktree of
an older commit) on the same patterns.

    .venv/bin/python bench/telemetry_bounds.py
    .venv/bin/python bench/telemetry_bounds.py --tree /tmp/base
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import msgpack
import psutil

ROOT = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024
TELEMETRY = "/v1/telemetry"

_SETUP = """
import sys
from sqlalchemy.orm import Session
from controlplane.auth.service import create_token
from controlplane.db import make_engine
from controlplane.migrate import upgrade
from controlplane.deployments.service import get_deployment
url, scope = sys.argv[1], sys.argv[2]
if scope == "admin":
    upgrade(url)
engine = make_engine(url)
with Session(engine) as session:
    deployment = get_deployment(session=session, name="chat") if scope == "runtime" else None
    _, secret = create_token(session=session, name=f"bench-{scope}", scope=scope,
                             deployment=deployment)
    session.commit()
print(secret)
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Api:
    """One API process of `tree`'s code on a fresh SQLite store, with a deployment `chat`."""

    def __init__(self, tree: Path, workdir: Path, output=None) -> None:
        self.env = {**os.environ, "PYTHONPATH": str(tree), "EXITPLANE_VAR_DIR": str(workdir),
                    "EXITPLANE_DATABASE_URL": f"sqlite:///{workdir / 'exitplane.db'}",
                    "EXITPLANE_LOG_LEVEL": "warning"}
        self.env.setdefault("EXITPLANE_SECRET_KEY", "bench-" + uuid.uuid4().hex + uuid.uuid4().hex)
        url = self.env["EXITPLANE_DATABASE_URL"]
        admin = self._setup(tree, url, "admin")
        self.port = _free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", "exitplane.app:create_app",
             "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"],
            cwd=tree, env=self.env, stdout=output, stderr=output)  # output: a file, or inherit
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the API did not start")
            time.sleep(0.2)
        operator = {"Authorization": f"Bearer {admin}"}
        created = httpx.post(f"{self.url}/v1/deployments", headers=operator, json={
            "name": "chat", "model_ref": "m", "num_layers": 12, "exit_layers": [3, 6, 9]})
        assert created.status_code == 201, created.text
        httpx.post(f"{self.url}/v1/deployments/chat/threshold-sets", headers=operator, json={
            "thresholds": {"3": 0.9, "6": 0.8, "9": 0.7}, "reason": "bench", "activate": True})
        self.runtime = {"Authorization": f"Bearer {self._setup(tree, url, 'runtime')}"}
        self.psutil = psutil.Process(self.process.pid)

    def _setup(self, tree: Path, url: str, scope: str) -> str:
        return subprocess.run([sys.executable, "-c", _SETUP, url, scope], cwd=tree, env=self.env,
                              check=True, capture_output=True, text=True).stdout.strip()

    def rss_mib(self) -> float:
        return self.psutil.memory_info().rss / MIB

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(10)


def _header(**extra) -> dict:
    return {"batch_id": uuid.uuid4().hex, "deployment": "chat", "runtime_id": "rt-1", "seq": 0,
            "num_layers": 12, **extra}


def expanding_batch(size: int = 14 * MIB) -> bytes:
    """A record batch whose `records` are lists of 1,000 zeros (one byte each)."""
    packer = msgpack.Packer(use_bin_type=True)
    header = _header()
    inner = packer.pack_array_header(1000) + b"\x00" * 1000
    count = size // len(inner)
    return packer.pack_map_header(len(header) + 1) + b"".join(
        packer.pack(key) + packer.pack(value) for key, value in header.items()) + \
        packer.pack("records") + packer.pack_array_header(count) + inner * count


def keyed_maps(size: int = 2 * MIB) -> bytes:
    """A record batch whose `records` are one-entry maps, each keyed by a new string: the
    shape that builds the most memory per value decoded (about 70 bytes a value)."""
    count = size // 10
    return msgpack.packb(_header(records=[{f"k{i:x}": 0} for i in range(count)]),
                         use_bin_type=True)


def shadow_columns(points: int = 1_200_000) -> bytes:
    """An interval batch of one record whose shadow columns hold `points` points."""
    now = int(time.time()) // 60 * 60
    records = {"threshold_version": [2], "request_id": ["r"], "position": [0],
               "exit_layer": [12], "signal_value": [0.5], "latency_us": [10], "ts": [now],
               "shadow_record": [0] * points, "shadow_layer": [3] * points,
               "shadow_signal": [0.123456789] * points, "shadow_matched": [True] * points}
    return msgpack.packb(_header(raw_sample_rate=0.0, cells=[], records=records),
                         use_bin_type=True)


class Peak:
    """The largest RSS of `api` seen while the block runs (sampled every 20 ms)."""

    def __init__(self, api: Api) -> None:
        self.api, self.peak, self._stop = api, api.rss_mib(), threading.Event()

    def __enter__(self) -> Peak:
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.api.rss_mib())
            time.sleep(0.02)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def unauth_slow_bodies(api: Api) -> list[int]:
    connections, statuses = [], []
    for _ in range(20):
        connection = socket.create_connection(("127.0.0.1", api.port), timeout=30)
        connection.sendall((f"POST {TELEMETRY} HTTP/1.1\r\nHost: x\r\nContent-Type: "
                            f"application/msgpack\r\nContent-Length: {16 * MIB - 1}\r\n\r\n"
                            ).encode())
        connections.append(connection)
    chunk = b"\x00" * MIB
    for connection in connections:
        connection.settimeout(0.5)
        try:
            for _ in range(15):
                connection.sendall(chunk)
        except (TimeoutError, OSError):
            pass  # the server stopped reading: it answered already
    time.sleep(3)  # held open
    for connection in connections:
        connection.settimeout(2)
        try:
            statuses.append(int(connection.recv(65536).split()[1]))
        except (TimeoutError, OSError, IndexError):
            statuses.append(0)  # no answer: the server still waits for the body
        connection.close()
    return statuses


def _post_all(api: Api, bodies: list[bytes], content_type: str) -> list[int]:
    def post(body: bytes) -> int:
        try:
            return httpx.post(f"{api.url}{TELEMETRY}", content=body, timeout=300, headers={
                **api.runtime, "Content-Type": content_type}).status_code
        except httpx.HTTPError:
            return 0

    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(post, bodies))


PATTERNS = {
    "unauth_slow_bodies": unauth_slow_bodies,
    "expanding_batch": lambda api: _post_all(api, [expanding_batch()], "application/msgpack"),
    "expanding_batch_x8": lambda api: _post_all(
        api, [expanding_batch() for _ in range(8)], "application/msgpack"),
    "keyed_maps_x8": lambda api: _post_all(
        api, [keyed_maps() for _ in range(8)], "application/msgpack"),
    "shadow_columns_x8": lambda api: _post_all(
        api, [shadow_columns() for _ in range(8)],
        "application/vnd.exitplane.interval+msgpack"),
    # Just within the default value budget (1,000,000): decoded and validated whole.
    "shadow_columns_in_budget_x8": lambda api: _post_all(
        api, [shadow_columns(240_000) for _ in range(8)],
        "application/vnd.exitplane.interval+msgpack"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose API runs")
    parser.add_argument("--patterns", default=",".join(PATTERNS))
    args = parser.parse_args()
    print("$", " ".join([Path(sys.executable).name, *sys.argv]), flush=True)
    for name in args.patterns.split(","):
        with tempfile.TemporaryDirectory() as workdir:
            api = Api(args.tree.resolve(), Path(workdir))
            try:
                # Warm: an honest batch, so the growth is the pattern's alone.
                honest = msgpack.packb(_header(records=[{
                    "threshold_version": 2, "request_id": "r", "position": 0, "exit_layer": 12,
                    "signal_value": 0.5, "latency_us": 10, "ts": time.time()}]))
                _post_all(api, [honest], "application/msgpack")
                time.sleep(0.5)
                before = api.rss_mib()
                with Peak(api) as peak:
                    statuses = PATTERNS[name](api)
                print(json.dumps({
                    "pattern": name, "tree": str(args.tree), "rss_before_mib": round(before, 1),
                    "rss_peak_mib": round(peak.peak, 1),
                    "growth_mib": round(peak.peak - before, 1),
                    "statuses": sorted(set(statuses)), "answers": len(statuses)}), flush=True)
            finally:
                api.close()


if __name__ == "__main__":
    main()
