"""PostgreSQL restarted under ingestion load: the API answers 503 with Retry-After while it is
down, nothing a runtime sent is lost or stored twice, and service resumes by itself."""

import tempfile
import time

import pytest

from controlplane.db import make_engine
from controlplane.migrate import upgrade
from controlplane.settings import Settings
from tests.support.served_api import RecordProducer, serve_deployment
from tests.support.waiting import wait_until

# slow: a private PostgreSQL stopped and restarted
pytestmark = pytest.mark.slow


@pytest.mark.postgres
def test_postgres_restart_under_ingestion_load(private_postgres):
    url = private_postgres.url
    upgrade(url)
    engine = make_engine(url)
    api = serve_deployment(Settings(database_url=url, var_dir=tempfile.mkdtemp()), engine)
    shipper = api.shipper(batch_records=50)
    producer = RecordProducer(shipper, per_tick=25, interval_s=0.02)
    producer.start()
    try:
        time.sleep(1.0)
        private_postgres.stop()
        down = api.probe()
        assert down.status_code == 503, down.text
        assert down.headers["retry-after"] and "unavailable" in down.json()["detail"]
        assert not api.ready()
        time.sleep(2.0)  # the runtime keeps producing while the store is away
        private_postgres.start()
        wait_until(api.ready, 60, "the API to recover", interval=0.2)
    finally:
        producer.stop()
    assert shipper.flush(60) and shipper.wait_replayed(60)
    shipper.close(30)
    assert shipper.dropped_records == 0
    assert api.stored() == producer.sent  # every record once: none lost, none doubled
    assert shipper.counters["spooled_batches"] + shipper.counters["retries"] > 0
    api.close()
    engine.dispose()
