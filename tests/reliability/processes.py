"""What the reliability tests share: service processes started the way an operator starts them,
the API serving one deployment to a runtime's shipper, and a producer of token records."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn
from sqlalchemy.orm import Session

from controlplane.auth.service import create_token
from controlplane.deployments.service import get_deployment
from exitplane.app import create_app
from exitplane.client.shipper import TelemetryShipper
from tests.conftest import CeleryWorker, free_port, patient_get, stop_process, wait_until

ROOT = Path(__file__).resolve().parents[2]
EXITPLANE = str(Path(sys.executable).parent / "exitplane")


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
        stop_process(process)

    def close(self) -> None:
        for process in self.running:
            if process.poll() is None:
                self.stop(process)

    def celery_worker(self, name: str) -> subprocess.Popen:
        """A Celery worker (tests/conftest.py's launcher) logging to <logs>/<name>.log."""
        process = CeleryWorker(env=self.env, log=self.logs / f"{name}.log", name=name).process
        self.running.append(process)
        return process


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


@dataclass
class ServedDeployment:
    """The API (uvicorn in a thread) with deployment `chat` (12 layers) and a runtime token."""

    base: str
    runtime_token: str
    server: uvicorn.Server

    @property
    def runtime_auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.runtime_token}"}

    def shipper(self, *, batch_records: int) -> TelemetryShipper:
        """A runtime's shipper with short retries, so outages reach its spool quickly."""
        return TelemetryShipper(base_url=self.base, token=self.runtime_token, deployment="chat",
                                runtime_id="rt-1", num_layers=12,
                                spool_dir=tempfile.mkdtemp(), batch_records=batch_records,
                                batch_interval_s=0.1, backoff_initial_s=0.05,
                                backoff_max_s=0.5, max_attempts=2).start()

    def stored(self) -> int:
        return patient_get(httpx, f"{self.base}/v1/deployments/chat/telemetry/count",
                           headers=self.runtime_auth, timeout=30).json()["records"]

    def probe(self) -> httpx.Response:
        """One batch of one record, posted directly (not through the shipper)."""
        return httpx.post(f"{self.base}/v1/telemetry", headers=self.runtime_auth, timeout=30,
                          json={"batch_id": uuid.uuid4().hex, "deployment": "chat",
                                "runtime_id": "probe", "seq": 0, "num_layers": 12,
                                "records": [{"threshold_version": 1, "request_id": "p",
                                             "position": 0, "exit_layer": 12,
                                             "signal_value": 0.5, "latency_us": 1,
                                             "ts": time.time()}]})

    def ready(self) -> bool:
        """The store and Redis answer the API now (the deep check, not the probe's)."""
        return httpx.get(f"{self.base}/readyz", params={"deep": "true"},
                         timeout=30).status_code == 200

    def close(self) -> None:
        self.server.should_exit = True


def serve_deployment(settings, engine) -> ServedDeployment:
    with Session(engine) as session:
        _, admin = create_token(session=session, name="admin", scope="admin")
        session.commit()
    server = uvicorn.Server(uvicorn.Config(create_app(settings, engine=engine), host="127.0.0.1",
                                           port=free_port(), log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    wait_until(lambda: server.started, 30, "the API to start")
    base = f"http://127.0.0.1:{server.config.port}"
    httpx.post(f"{base}/v1/deployments", headers={"Authorization": f"Bearer {admin}"}, json={
        "name": "chat", "model_ref": "m", "num_layers": 12, "exit_layers": [3, 6, 9]}
    ).raise_for_status()
    with Session(engine) as session:
        _, runtime = create_token(session=session, name="rt", scope="runtime",
                                  deployment=get_deployment(session=session, name="chat"))
        session.commit()
    return ServedDeployment(base=base, runtime_token=runtime, server=server)


def start_api(processes: Processes, name: str) -> str:
    """One API process as compose runs it (`exitplane up --no-workers`, the schema already
    migrated) on a free loopback port; returns its base URL once it answers /readyz."""
    port = free_port()
    process = processes.start(name, [EXITPLANE, "up", "--host", "127.0.0.1", "--port", str(port),
                                     "--no-migrate", "--no-workers"])
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"{name} exited: see {processes.logs / (name + '.log')}")
        try:
            return httpx.get(f"{base}/readyz", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(ready, 90, f"{name} to be ready")
    return base
