"""Fixtures for the alert tests: a real HTTP receiver (the outbox fixture: tests/conftest.py)."""

from __future__ import annotations

import pytest

from tests.controlplane.alerts.support import Receiver


@pytest.fixture
def receiver():
    server = Receiver().start()
    yield server
    server.stop()
