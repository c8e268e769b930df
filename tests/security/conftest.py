"""Fixtures the security tests share."""

import pytest
from fastapi.testclient import TestClient

from exitplane.app import create_app


@pytest.fixture
def serve(settings, engine):
    """Start the app with settings overrides (`serve(rate_limit_read_per_s=5)`) on this test's
    database; every app started is closed at the end of the test."""
    opened = []

    def start(**overrides) -> TestClient:
        app = create_app(settings.model_copy(update=overrides), engine=engine)
        client = TestClient(app)
        client.__enter__()
        opened.append((app, client))
        return client

    yield start
    for app, client in opened:
        client.__exit__(None, None, None)
        app.state.config_delivery.close()
        app.state.heartbeats.close()
