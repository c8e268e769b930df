"""Service processes started the way an operator starts them, stopped at the end of a test."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
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


class RecordProducer:
    """A runtime's decode loop as far as telemetry goes: `per_tick` token records handed to the
    shipper every `interval_s`, counted, until stopped."""

    def __init__(self, shipper, *, per_tick: int, interval_s: float) -> None:
        self.shipper, self.per_tick, self.interval_s = shipper, per_tick, interval_s
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        from exitplane.wire import TokenRecord

        while not self._stop.is_set():
            for _ in range(self.per_tick):
                self.shipper.submit(TokenRecord(
                    threshold_version=1, request_id=uuid.uuid4().hex, position=0,
                    exit_layer=12, signal_value=0.5, latency_us=10, ts=time.time()))
                self.sent += 1
            time.sleep(self.interval_s)

    def start(self) -> RecordProducer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
