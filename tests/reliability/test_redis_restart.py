"""Redis crashed (SIGKILL) and restarted under production load: telemetry stream entries that a
consumer had read but not committed are re-read and stored once, the API answers 503 with
Retry-After while the queue is away, and Celery tasks queued before the crash run after it on
a worker that started during the outage."""

import os
import tempfile
import threading
import time
import uuid

import httpx
import pytest
import redis
import uvicorn
from sqlalchemy.orm import Session

from controlplane.app import create_app
from controlplane.auth.service import create_token
from controlplane.db import make_engine
from controlplane.settings import Settings
from controlplane.telemetry.stream import GROUP, stream_key
from controlplane.thresholds.service import get_deployment
from runtime.shipper import TelemetryShipper
from tests.conftest import free_port
from tests.reliability.processes import EXITPLANE, Processes, RecordProducer, wait
from workers.celery_app import make_celery


@pytest.mark.postgres
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_redis_crash_and_restart(private_redis, db_url, tmp_path):
    settings = Settings(database_url=db_url, var_dir=tmp_path / "var",
                        redis_url=private_redis.url)
    env = {**os.environ, "EXITPLANE_DATABASE_URL": db_url, "EXITPLANE_REDIS_URL":
           private_redis.url, "EXITPLANE_VAR_DIR": str(settings.var_dir)}
    processes = Processes(env, tmp_path)
    engine = make_engine(db_url)
    with Session(engine) as session:
        _, admin = create_token(session=session, name="admin", scope="admin")
        session.commit()
    server = uvicorn.Server(uvicorn.Config(create_app(settings, engine=engine), host="127.0.0.1",
                                           port=free_port(), log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    wait(lambda: server.started, 30, "the API to start")
    base = f"http://127.0.0.1:{server.config.port}"
    httpx.post(f"{base}/v1/deployments", headers={"Authorization": f"Bearer {admin}"}, json={
        "name": "chat", "model_ref": "m", "num_layers": 12, "exit_layers": [3, 6, 9]}
    ).raise_for_status()
    with Session(engine) as session:
        _, runtime = create_token(session=session, name="rt", scope="runtime",
                                  deployment=get_deployment(session=session, name="chat"))
        session.commit()
    runtime_auth = {"Authorization": f"Bearer {runtime}"}

    def stored() -> int:
        return httpx.get(f"{base}/v1/deployments/chat/telemetry/count", headers=runtime_auth,
                         timeout=30).json()["records"]

    shipper = TelemetryShipper(base_url=base, token=runtime, deployment="chat",
                               runtime_id="rt-1", num_layers=12,
                               spool_dir=tempfile.mkdtemp(), batch_records=20,
                               batch_interval_s=0.1, backoff_initial_s=0.05,
                               backoff_max_s=0.5, max_attempts=2).start()
    producer = RecordProducer(shipper, per_tick=10, interval_s=0.05)
    client = redis.Redis.from_url(private_redis.url)
    try:
        processes.start("ingest", [EXITPLANE, "ingest", "--name", "ingest-a",
                                   "--claim-idle-ms", "10000"])
        worker_a = processes.celery_worker("worker-a")
        celery = make_celery(settings)
        assert celery.send_task("retention.run").get(timeout=120)["token_records"] == 0
        producer.start()
        wait(lambda: stored() > 0, 60, "the ingest worker to store records")

        # A consumer reads entries and dies with Redis before committing them: they stay
        # pending in the consumer group, which the append-only file brings back.
        stream = stream_key("chat")

        def read_some():
            response = client.xreadgroup(GROUP, "doomed", {stream: ">"}, count=5, block=200)
            return [entry_id for _, entries in response or [] for entry_id, _ in entries]

        # A task queued while no worker listens must survive the crash.
        processes.stop(worker_a)
        queued = celery.send_task("retention.run")
        doomed = wait(read_some, 30, "entries to read before the ingest worker does")
        private_redis.kill()

        probe = httpx.post(f"{base}/v1/telemetry", headers=runtime_auth, timeout=30, json={
            "batch_id": uuid.uuid4().hex, "deployment": "chat", "runtime_id": "probe",
            "seq": 0, "num_layers": 12, "records": [{
                "threshold_version": 1, "request_id": "p", "position": 0, "exit_layer": 12,
                "signal_value": 0.5, "latency_us": 1, "ts": time.time()}]})
        assert probe.status_code == 503, probe.text
        assert probe.headers["retry-after"] and "queue is unavailable" in probe.json()["detail"]
        assert httpx.get(f"{base}/readyz", timeout=30).status_code == 503
        processes.celery_worker("worker-b")  # starts while the broker is away
        time.sleep(2.0)  # the runtime keeps producing: its shipper retries, then spools

        private_redis.start()
        held = client.xpending_range(stream, GROUP, min="-", max="+", count=100,
                                     consumername="doomed")
        assert [entry["message_id"] for entry in held] == doomed  # back from the AOF
        wait(lambda: httpx.get(f"{base}/readyz", timeout=30).status_code == 200, 60,
              "the API to be ready again")
        assert queued.get(timeout=120)["token_records"] == 0  # ran after the restart
        assert celery.send_task("retention.run").get(timeout=120)["token_records"] == 0
    finally:
        producer.stop()
    try:
        assert shipper.flush(60) and shipper.wait_replayed(60)
        shipper.close(30)
        assert shipper.dropped_records == 0
        assert shipper.counters["spooled_batches"] + shipper.counters["retries"] > 0
        wait(lambda: stored() >= producer.sent, 120, f"all {producer.sent} records to be stored")
        time.sleep(1.0)  # a duplicate would land now
        assert stored() == producer.sent  # every record once: none lost, none doubled
        # The entries the dead consumer held were reclaimed by the ingest worker.
        pending = client.xpending_range(stream, GROUP, min="-", max="+", count=1000)
        assert pending == []
        assert len(doomed) >= 1
    finally:
        processes.close()
        server.should_exit = True
        client.close()
        engine.dispose()
