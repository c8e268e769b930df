"""An ingest worker with no telemetry stream yet waits like a blocking read instead of spinning
on Redis (a loop on SMEMBERS as fast as Redis answers would take a core from the API)."""

import threading
import time

import pytest
import redis

from controlplane.telemetry.stream import StreamIngestor
from tests.support.services import REDIS_URL

# A database number of its own: the test Redis is shared with other suites.
OWN_REDIS_URL = REDIS_URL.rsplit("/", 1)[0] + "/15" if REDIS_URL else ""


@pytest.mark.redis
def test_an_idle_worker_waits_and_stops_promptly():
    if not OWN_REDIS_URL:
        raise RuntimeError("set EXITPLANE_TEST_REDIS_URL (make test starts Redis)")
    client = redis.Redis.from_url(OWN_REDIS_URL)
    client.flushdb()  # no stream: no deployment has sent telemetry
    worker = StreamIngestor(client, session_factory=None, name="idle", block_ms=400)
    started = time.monotonic()
    assert worker.run_once() == 0
    assert time.monotonic() - started >= 0.35

    stop = threading.Event()
    loop = threading.Thread(target=worker.run_forever, args=(stop,))
    loop.start()
    time.sleep(0.1)
    stopped = time.monotonic()
    stop.set()
    loop.join(5)
    assert not loop.is_alive() and time.monotonic() - stopped < 0.35
