"""Fixtures for the alert tests: the task outbox captured, a real HTTP receiver."""

from __future__ import annotations

import pytest

from tests.controlplane.alerts.support import Receiver


@pytest.fixture
def outbox(monkeypatch) -> list[tuple[str, list]]:
    """Tasks the services hand to the broker after commit, captured instead of sent."""
    sent: list[tuple[str, list]] = []
    monkeypatch.setattr("controlplane.outbox.send_task",
                        lambda name, args: sent.append((name, list(args))))
    return sent


@pytest.fixture
def receiver():
    server = Receiver().start()
    yield server
    server.stop()
