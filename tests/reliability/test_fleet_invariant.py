"""Edge aggregation stays exact through crashes: three aggregating runtimes (1% shadow, 5% raw
sample) ship to an API process feeding the Redis stream and an ingest worker process, while the
API, the ingest worker and Redis are each SIGKILLed and brought back. Afterwards the tokens the
rollups count equal the tokens the runtimes generated, exactly, and every shipped record is
stored once."""

from __future__ import annotations

import os
import random
import secrets
import signal
import tempfile
import threading
import time

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from controlplane.auth.service import create_token
from controlplane.deployments.service import get_deployment
from exitplane.client.shipper import TelemetryShipper
from exitplane.wire import ShadowPoint, TokenRecord
from tests.support.network import free_port
from tests.support.processes import EXITPLANE, Processes
from tests.support.waiting import wait_until

# slow: service processes killed and restarted
pytestmark = pytest.mark.slow

EXIT_LAYERS, NUM_LAYERS = [3, 6, 9], 12


class Runtime:
    """A runtime's decode loop as far as telemetry goes: a realistic exit mix, 1% shadow."""

    def __init__(self, shipper: TelemetryShipper, seed: int) -> None:
        self.shipper, self.rng = shipper, random.Random(seed)
        self.generated = self.records = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._stop.is_set():
            for position in range(50):
                shadow = self.rng.random() < 0.01
                layer = NUM_LAYERS if shadow else self.rng.choice([*EXIT_LAYERS, NUM_LAYERS])
                record = TokenRecord(
                    threshold_version=1, request_id=f"r{self.generated // 50}",
                    position=position, exit_layer=layer, signal_value=self.rng.random(),
                    latency_us=50, ts=time.time(),
                    shadow=[ShadowPoint(layer=k, signal=self.rng.random(), matched=True)
                            for k in EXIT_LAYERS] if shadow else None)
                assert self.shipper.submit(record)
                self.generated += 1
            time.sleep(0.02)

    def start(self) -> Runtime:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _counted(engine) -> int:
    with engine.connect() as connection:
        return int(connection.execute(text(
            "SELECT coalesce(sum(tokens), 0) FROM rollups WHERE layer = :first"),
            {"first": EXIT_LAYERS[0]}).scalar())


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_token_counts_are_exact_through_kills(private_redis, db_url, engine, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "EXITPLANE_DATABASE_URL": db_url, "EXITPLANE_REDIS_URL":
           private_redis.url, "EXITPLANE_VAR_DIR": str(tmp_path / "var"),
           "EXITPLANE_SECRET_KEY": secrets.token_urlsafe(48),
           "EXITPLANE_ENVIRONMENT": "production"}
    processes = Processes(env, tmp_path)
    api_command = [EXITPLANE, "up", "--host", "127.0.0.1", "--port", str(port), "--no-migrate",
                   "--no-workers"]
    ingest_command = [EXITPLANE, "ingest", "--name", "ingest-a", "--claim-idle-ms", "1000"]

    def ready() -> bool:
        try:
            return httpx.get(f"{base}/readyz?deep=true", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    with Session(engine) as session:
        _, admin = create_token(session=session, name="admin", scope="admin")
        session.commit()
    api = processes.start("api", api_command)
    ingest = processes.start("ingest", ingest_command)
    runtimes: list[Runtime] = []
    try:
        wait_until(ready, 60, "the API to start")
        ops = {"Authorization": f"Bearer {admin}"}
        httpx.post(f"{base}/v1/deployments", headers=ops, timeout=30, json={
            "name": "chat", "model_ref": "m", "num_layers": NUM_LAYERS,
            "exit_layers": EXIT_LAYERS}).raise_for_status()
        httpx.post(f"{base}/v1/deployments/chat/threshold-sets", headers=ops, timeout=30, json={
            "thresholds": {"3": 0.9, "6": 0.8, "9": 0.7}, "reason": "test",
            "activate": True}).raise_for_status()
        with Session(engine) as session:
            _, token = create_token(session=session, name="rt", scope="runtime",
                                    deployment=get_deployment(session=session, name="chat"))
            session.commit()
        for index in range(3):
            shipper = TelemetryShipper(
                base_url=base, token=token, deployment="chat", runtime_id=f"rt-{index}",
                num_layers=NUM_LAYERS, exit_layers=EXIT_LAYERS, raw_sample_rate=0.05,
                spool_dir=tempfile.mkdtemp(dir=tmp_path), batch_records=200,
                batch_interval_s=0.1, aggregate_interval_s=0.3, backoff_initial_s=0.05,
                backoff_max_s=0.5, max_attempts=2, fsync=False).start()
            runtimes.append(Runtime(shipper, seed=index).start())
        wait_until(lambda: _counted(engine) > 0, 60, "the first aggregates to be stored")

        # The API dies mid-traffic (runtimes retry, then spool) and comes back.
        api.send_signal(signal.SIGKILL)
        api.wait()
        time.sleep(1.0)
        api = processes.start("api", api_command)
        wait_until(ready, 60, "the API to restart")
        # The ingest worker dies holding entries it read; its successor reclaims them.
        time.sleep(1.0)
        ingest.send_signal(signal.SIGKILL)
        ingest.wait()
        time.sleep(1.0)
        ingest = processes.start("ingest", ingest_command)
        # Redis dies (the stream comes back from its append-only file).
        time.sleep(1.0)
        private_redis.kill()
        time.sleep(1.5)
        private_redis.start()
        wait_until(ready, 60, "the API to be ready with Redis back")
        time.sleep(1.0)
    finally:
        for runtime in runtimes:
            runtime.stop()
    try:
        for runtime in runtimes:
            assert runtime.shipper.flush(60) and runtime.shipper.wait_replayed(120)
        generated = sum(runtime.generated for runtime in runtimes)
        wait_until(lambda: _counted(engine) >= generated, 120,
                   "the ingest worker to store every aggregate")
        time.sleep(1.0)  # anything counted twice would show up now
        assert _counted(engine) == generated
        # A batch stored just before a kill whose answer never came back is acknowledged on
        # replay as a duplicate: delivered once, counted once, under duplicate_*.
        shipped = sum(runtime.shipper.counters["sent_records"]
                      + runtime.shipper.counters["duplicate_records"] for runtime in runtimes)
        with engine.connect() as connection:
            stored = connection.execute(text("SELECT count(*) FROM token_records")).scalar()
        assert stored == shipped < generated / 10  # sampled: every record once
        # The outages were felt: runtimes retried and spooled, and still nothing was lost.
        assert sum(r.shipper.counters["send_errors"] for r in runtimes) > 0
        assert sum(r.shipper.counters["spooled_batches"] for r in runtimes) > 0
        for runtime in runtimes:
            assert runtime.shipper.dropped_records == 0
            counters = runtime.shipper.counters
            assert (counters["sent_aggregate_tokens"] + counters["duplicate_aggregate_tokens"]
                    == runtime.generated)
            assert runtime.shipper.close(30)
    finally:
        processes.close()


