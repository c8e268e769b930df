"""The API (uvicorn in a thread) serving one deployment to a runtime's shipper, and a producer
of token records: what a runtime's telemetry path meets, for tests that break the services under
it."""

from __future__ import annotations

import tempfile
import threading
import time
import uuid
from dataclasses import dataclass

import httpx
import uvicorn
from sqlalchemy.orm import Session

from controlplane.auth.service import create_token
from controlplane.deployments.service import get_deployment
from exitplane.app import create_app
from exitplane.client.shipper import TelemetryShipper
from tests.support.batches import telemetry_batch
from tests.support.network import free_port
from tests.support.waiting import patient_get, wait_until


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
                          json=telemetry_batch([{"threshold_version": 1, "request_id": "p",
                                                 "position": 0, "exit_layer": 12,
                                                 "signal_value": 0.5, "latency_us": 1,
                                                 "ts": time.time()}], runtime_id="probe"))

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
