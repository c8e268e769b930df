"""Sign-in flood benchmark: what an anonymous flood of password checks does to a real
`exitplane up` on SQLite (the embedded default): runtime heartbeat latency, errors, memory.

Starts `exitplane up --no-workers` on a fresh var dir with one user (argon2id at its shipped
cost), a deployment and a runtime token. A runtime heartbeats every `--beat-every` seconds, each
beat from a new runtime id (so each one writes to the store), first alone, then while
`--signins` sign-ins with random usernames run `--concurrency` at a time: from one address, or
(`--addresses many`) through a trusted proxy (127.0.0.1 in EXITPLANE_TRUSTED_PROXIES) from a new
address each. Prints one JSON line: the sign-ins' answers, any 5xx, heartbeat latency alone and
under the flood, and the API process's resident memory growth during the flood.

    .venv/bin/python bench/signin_flood.py --signins 120 --concurrency 40 --addresses one
    .venv/bin/python bench/signin_flood.py --signins 120 --concurrency 40 --addresses many

`--root DIR` serves the control plane from another checkout of the source (e.g. an older
commit extracted with `git archive`), to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
CSRF_FIELD = re.compile(r'name="csrf_token" value="([^"]+)"')


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    pick = lambda q: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)  # noqa: E731
    return {"p50": pick(0.5), "p99": pick(0.99), "max": round(ordered[-1], 1),
            "count": len(ordered)}


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Server:
    """`exitplane up --no-workers` from `root` on a fresh SQLite var dir."""

    def __init__(self, root: Path, var_dir: Path, trusted_proxies: str) -> None:
        self.root = root
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("EXITPLANE_")}
        self.env.update({"EXITPLANE_VAR_DIR": str(var_dir), "EXITPLANE_LOG_LEVEL": "warning",
                         "EXITPLANE_TRUSTED_PROXIES": trusted_proxies,
                         "PYTHONPATH": str(root)})
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def cli(self, *args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "exitplane.cli", *args], cwd=self.root,
                              env=self.env, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"exitplane {' '.join(args)} failed: {done.stderr[-2000:]}")
        return done.stdout.strip()

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "exitplane.cli", "up", "--no-workers", "--no-migrate",
             "--port", str(self.port)], cwd=self.root, env=self.env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the API did not come up")
            time.sleep(0.3)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=60)


def _beats(server: Server, token: str, every: float, stop: threading.Event,
           prefix: str) -> tuple[list[float], Counter]:
    latencies: list[float] = []
    statuses: Counter = Counter()
    with httpx.Client(base_url=server.url, timeout=120,
                      headers={"Authorization": f"Bearer {token}"}) as client:
        index = 0
        while not stop.is_set():
            index += 1
            started = time.perf_counter()
            try:
                answer = client.post("/v1/deployments/bench/heartbeats",
                                     json={"runtime_id": f"{prefix}-{index}"})
                statuses[answer.status_code] += 1
            except httpx.HTTPError as error:
                statuses[type(error).__name__] += 1
            latencies.append((time.perf_counter() - started) * 1000)
            stop.wait(every)
    return latencies, statuses


def _sign_ins(server: Server, count: int, concurrency: int, many: bool) -> Counter:
    answers: Counter = Counter()
    lock = threading.Lock()
    per_worker = [count // concurrency + (i < count % concurrency) for i in range(concurrency)]

    def worker(tries: int) -> None:
        with httpx.Client(base_url=server.url, timeout=300) as client:
            match = CSRF_FIELD.search(client.get("/ui/login").text)
            token = match.group(1) if match else ""
            for _ in range(tries):
                headers = ({"X-Forwarded-For": f"10.{secrets.randbelow(250)}."
                                               f"{secrets.randbelow(250)}.{secrets.randbelow(250)}"}
                           if many else {})
                try:
                    status = client.post("/ui/login", headers=headers, data={
                        "username": f"nobody-{secrets.token_hex(6)}",
                        "password": "not the password", "csrf_token": token}).status_code
                except httpx.HTTPError as error:
                    status = type(error).__name__
                with lock:
                    answers[status] += 1

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(worker, per_worker))
    return answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--signins", type=int, default=120)
    parser.add_argument("--concurrency", type=int, default=40)
    parser.add_argument("--addresses", choices=["one", "many"], default="one")
    parser.add_argument("--beat-every", type=float, default=0.1)
    parser.add_argument("--idle-s", type=float, default=3.0)
    parser.add_argument("--root", type=Path, default=ROOT)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="exitplane-signin-flood-") as scratch:
        server = Server(args.root.resolve(), Path(scratch) / "var",
                        trusted_proxies="127.0.0.1" if args.addresses == "many" else "")
        server.cli("db", "upgrade")
        password_file = Path(scratch) / "password"
        password_file.write_text(secrets.token_urlsafe(16) + "\n")
        server.cli("bootstrap", "user", "--username", "admin", "--role", "admin",
                   "--password-file", str(password_file))
        server.cli("bootstrap", "deployment", "--name", "bench", "--model-ref", "bench-model",
                   "--num-layers", "12", "--exit-layers", "3,6,9")
        token = server.cli("bootstrap", "token", "--name", "runtime", "--scope", "runtime",
                           "--deployment", "bench")
        server.start()
        try:
            stop = threading.Event()
            timer = threading.Timer(args.idle_s, stop.set)
            timer.start()
            idle, idle_statuses = _beats(server, token, args.beat_every, stop, "idle")
            rss_before = _rss_mib(server.process.pid)
            rss_peak = [rss_before]
            stop = threading.Event()

            def watch_memory() -> None:
                while not stop.wait(0.05):
                    rss_peak[0] = max(rss_peak[0], _rss_mib(server.process.pid))

            flood_beats: list = []
            beating = threading.Thread(target=lambda: flood_beats.append(
                _beats(server, token, args.beat_every, stop, "flood")))
            watcher = threading.Thread(target=watch_memory)
            beating.start()
            watcher.start()
            started = time.monotonic()
            answers = _sign_ins(server, args.signins, args.concurrency,
                                args.addresses == "many")
            flood_s = time.monotonic() - started
            stop.set()
            beating.join()
            watcher.join()
            latencies, beat_statuses = flood_beats[0]
        finally:
            server.stop()
    statuses = answers + idle_statuses + beat_statuses
    print(json.dumps({
        "addresses": args.addresses, "signins": args.signins, "concurrency": args.concurrency,
        "answers": {str(k): v for k, v in sorted(answers.items(), key=str)},
        "errors_5xx": sum(n for status, n in statuses.items()
                          if isinstance(status, int) and status >= 500),
        "heartbeats": {str(k): v for k, v in sorted((idle_statuses + beat_statuses).items(),
                                                     key=str)},
        "heartbeat_ms_alone": _percentiles(idle), "heartbeat_ms_flood": _percentiles(latencies),
        "flood_s": round(flood_s, 1),
        "api_rss_growth_mib": round(rss_peak[0] - rss_before, 1),
        "command": " ".join(["bench/signin_flood.py", *sys.argv[1:]])}))


if __name__ == "__main__":
    main()
