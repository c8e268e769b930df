"""Service processes started the way an operator starts them, stopped at the end of a test."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXITPLANE = str(Path(sys.executable).parent / "exitplane")


def wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


class Processes:
    """Service processes of the test (ingest worker, Celery workers), stopped at the end."""

    def __init__(self, env: dict, logs: Path) -> None:
        self.env, self.logs, self.running = env, logs, []

    def start(self, name: str, command: list[str]) -> subprocess.Popen:
        with (self.logs / f"{name}.log").open("a") as out:
            process = subprocess.Popen(command, cwd=ROOT, env=self.env, stdout=out,
                                       stderr=subprocess.STDOUT)
        self.running.append(process)
        return process

    def stop(self, process: subprocess.Popen) -> None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def close(self) -> None:
        for process in self.running:
            if process.poll() is None:
                self.stop(process)

    def celery_worker(self, name: str) -> subprocess.Popen:
        return self.start(name, [
            sys.executable, "-m", "celery", "-A", "workers.celery_app", "worker", "--pool=solo",
            "--loglevel=INFO", "--without-gossip", "--without-mingle", "--without-heartbeat",
            "-n", f"{name}-{os.getpid()}@localhost"])
