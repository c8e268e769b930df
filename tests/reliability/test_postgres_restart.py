"""PostgreSQL restarted under ingestion load: the API answers 503 with Retry-After while it is
down, nothing a runtime sent is lost or stored twice, and service resumes by itself."""

import tempfile
import threading
import time
import uuid

import httpx
import pytest
import uvicorn
from sqlalchemy.orm import Session

from controlplane.app import create_app
from controlplane.auth.service import create_token
from controlplane.db import make_engine
from controlplane.migrate import upgrade
from controlplane.settings import Settings
from controlplane.thresholds.service import get_deployment
from runtime.shipper import TelemetryShipper
from tests.conftest import free_port
from tests.reliability.processes import RecordProducer


@pytest.mark.postgres
def test_postgres_restart_under_ingestion_load(private_postgres):
    url = private_postgres.url
    upgrade(url)
    engine = make_engine(url)
    with Session(engine) as session:
        _, admin = create_token(session=session, name="admin", scope="admin")
        session.commit()
    app = create_app(Settings(database_url=url, var_dir=tempfile.mkdtemp()), engine=engine)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {admin}"}
    httpx.post(f"{base}/v1/deployments", headers=auth, json={
        "name": "chat", "model_ref": "m", "num_layers": 12, "exit_layers": [3, 6, 9]}
    ).raise_for_status()
    with Session(engine) as session:
        _, runtime = create_token(session=session, name="rt", scope="runtime",
                                  deployment=get_deployment(session=session, name="chat"))
        session.commit()
    shipper = TelemetryShipper(base_url=base, token=runtime, deployment="chat",
                               runtime_id="rt-1", num_layers=12,
                               spool_dir=tempfile.mkdtemp(), batch_records=50,
                               batch_interval_s=0.1, backoff_initial_s=0.05,
                               backoff_max_s=0.5, max_attempts=2).start()
    producer = RecordProducer(shipper, per_tick=25, interval_s=0.02)
    producer.start()
    try:
        time.sleep(1.0)
        private_postgres.stop()
        down = httpx.post(f"{base}/v1/telemetry", headers={"Authorization": f"Bearer {runtime}"},
                          json={"batch_id": uuid.uuid4().hex, "deployment": "chat",
                                "runtime_id": "probe", "seq": 0, "num_layers": 12,
                                "records": [{"threshold_version": 1, "request_id": "p",
                                             "position": 0, "exit_layer": 12,
                                             "signal_value": 0.5, "latency_us": 1,
                                             "ts": time.time()}]}, timeout=30)
        assert down.status_code == 503, down.text
        assert down.headers["retry-after"] and "unavailable" in down.json()["detail"]
        assert httpx.get(f"{base}/readyz", timeout=30).status_code == 503
        time.sleep(2.0)  # the runtime keeps producing while the store is away
        private_postgres.start()
        deadline = time.monotonic() + 60
        while httpx.get(f"{base}/readyz", timeout=30).status_code != 200:
            assert time.monotonic() < deadline, "the API did not recover"
            time.sleep(0.2)
    finally:
        producer.stop()
    assert shipper.flush(60) and shipper.wait_replayed(60)
    shipper.close(30)
    counts = httpx.get(f"{base}/v1/deployments/chat/telemetry/count",
                       headers={"Authorization": f"Bearer {runtime}"}).json()
    assert shipper.dropped_records == 0
    assert counts["records"] == producer.sent  # every record once: none lost, none doubled
    assert shipper.counters["spooled_batches"] + shipper.counters["retries"] > 0
    server.should_exit = True
    engine.dispose()
