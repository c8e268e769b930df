"""Redis crashed (SIGKILL) and restarted under production load: telemetry stream entries that a
consumer had read but not committed are re-read and stored once, the API answers 503 with
Retry-After while the queue is away, and Celery tasks queued before the crash run after it on
a worker that started during the outage."""

import os
import time

import pytest
import redis

from controlplane.celery_app import make_celery
from controlplane.db import make_engine
from controlplane.settings import Settings
from controlplane.telemetry.stream import GROUP, stream_key
from tests.support.processes import EXITPLANE, Processes
from tests.support.served_api import RecordProducer, serve_deployment
from tests.support.waiting import wait_until

# slow: a private Redis and Celery workers
pytestmark = pytest.mark.slow


@pytest.mark.postgres
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_redis_crash_and_restart(private_redis, db_url, tmp_path):
    settings = Settings(database_url=db_url, var_dir=tmp_path / "var",
                        redis_url=private_redis.url)
    env = {**os.environ, "EXITPLANE_DATABASE_URL": db_url, "EXITPLANE_REDIS_URL":
           private_redis.url, "EXITPLANE_VAR_DIR": str(settings.var_dir)}
    processes = Processes(env, tmp_path)
    engine = make_engine(db_url)
    api = serve_deployment(settings, engine)
    shipper = api.shipper(batch_records=20)
    producer = RecordProducer(shipper, per_tick=10, interval_s=0.05)
    client = redis.Redis.from_url(private_redis.url)
    try:
        processes.start("ingest", [EXITPLANE, "ingest", "--name", "ingest-a",
                                   "--claim-idle-ms", "10000"])
        worker_a = processes.celery_worker("worker-a")
        celery = make_celery(settings)
        assert celery.send_task("retention.run").get(timeout=120)["token_records"] == 0
        producer.start()
        wait_until(lambda: api.stored() > 0, 60, "the ingest worker to store records")

        # A consumer reads entries and dies with Redis before committing them: they stay
        # pending in the consumer group, which the append-only file brings back.
        stream = stream_key("chat")

        def read_some():
            response = client.xreadgroup(GROUP, "doomed", {stream: ">"}, count=5, block=200)
            return [entry_id for _, entries in response or [] for entry_id, _ in entries]

        # A task queued while no worker listens must survive the crash.
        processes.stop(worker_a)
        queued = celery.send_task("retention.run")
        doomed = wait_until(read_some, 30, "entries to read before the ingest worker does")
        private_redis.kill()

        probe = api.probe()
        assert probe.status_code == 503, probe.text
        assert probe.headers["retry-after"] and "queue is unavailable" in probe.json()["detail"]
        assert not api.ready()
        processes.celery_worker("worker-b")  # starts while the broker is away
        time.sleep(2.0)  # the runtime keeps producing: its shipper retries, then spools

        private_redis.start()
        held = client.xpending_range(stream, GROUP, min="-", max="+", count=100,
                                     consumername="doomed")
        assert [entry["message_id"] for entry in held] == doomed  # back from the AOF
        wait_until(api.ready, 60, "the API to be ready again", interval=0.1)
        assert queued.get(timeout=120)["token_records"] == 0  # ran after the restart
        assert celery.send_task("retention.run").get(timeout=120)["token_records"] == 0
    finally:
        producer.stop()
    try:
        assert shipper.flush(60) and shipper.wait_replayed(60)
        shipper.close(30)
        assert shipper.dropped_records == 0
        assert shipper.counters["spooled_batches"] + shipper.counters["retries"] > 0
        wait_until(lambda: api.stored() >= producer.sent, 120,
                   f"all {producer.sent} records to be stored")
        time.sleep(1.0)  # a duplicate would land now
        assert api.stored() == producer.sent  # every record once: none lost, none doubled
        # The entries the dead consumer held were reclaimed by the ingest worker.
        pending = client.xpending_range(stream, GROUP, min="-", max="+", count=1000)
        assert pending == []
        assert len(doomed) >= 1
    finally:
        processes.close()
        api.close()
        client.close()
        engine.dispose()
