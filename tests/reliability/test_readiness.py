"""An API process's readiness (the probe that keeps it in the load balancer) through a store
outage: it stays ready, since every replica sees the same outage and its caches still answer
pulls (the rest gets 503 with Retry-After), while the deep check reports the store away. A
process the store never answered is not ready."""

import tempfile

import httpx
import pytest
from fastapi.testclient import TestClient

from controlplane.db import make_engine
from controlplane.migrate import upgrade
from controlplane.settings import Settings
from exitplane.app import create_app
from tests.support.served_api import serve_deployment
from tests.support.waiting import wait_until

# slow: a private PostgreSQL stopped and restarted
pytestmark = [pytest.mark.slow, pytest.mark.postgres]


def test_a_store_outage_leaves_the_api_ready_and_its_caches_serving(private_postgres):
    url = private_postgres.url
    upgrade(url)
    engine = make_engine(url)
    # caches that outlast the outage, so that the pull below is answered from them
    settings = Settings(database_url=url, var_dir=tempfile.mkdtemp(), token_cache_ttl_s=30,
                        config_cache_ttl_s=30)
    api = serve_deployment(settings, engine)
    pull = f"{api.base}/v1/deployments/chat/thresholds"
    params = {"runtime_id": "rt-1"}
    try:
        etag = httpx.get(pull, params=params, headers=api.runtime_auth, timeout=30
                         ).raise_for_status().headers["etag"]
        cached = {**api.runtime_auth, "If-None-Match": etag}
        assert httpx.get(pull, params=params, headers=cached, timeout=30).status_code == 304
        assert httpx.get(f"{api.base}/readyz", timeout=30).json() == {"status": "ready"}

        private_postgres.stop()
        ready = httpx.get(f"{api.base}/readyz", timeout=30)
        assert ready.status_code == 200, ready.text  # still in the Service
        deep = httpx.get(f"{api.base}/readyz", params={"deep": "true"}, timeout=30)
        assert deep.status_code == 503 and deep.headers["retry-after"] == "2"
        assert deep.json()["status"] == "unavailable"
        assert not api.ready()
        assert httpx.get(pull, params=params, headers=cached, timeout=30).status_code == 304
        assert api.probe().status_code == 503  # what needs the store says so, to be retried

        # A process started while the store is away has nothing to serve from: not ready.
        fresh = TestClient(create_app(settings, engine=make_engine(url)))
        unready = fresh.get("/readyz")
        assert unready.status_code == 503 and unready.headers["retry-after"] == "2"
        assert "has not answered" in unready.json()["detail"]

        private_postgres.start()
        wait_until(api.ready, 60, "the deep check to see the store again", interval=0.2)
        assert fresh.get("/readyz").status_code == 200  # ready once the store answered it
    finally:
        api.close()
        engine.dispose()
