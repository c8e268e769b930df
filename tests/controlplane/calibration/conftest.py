"""Fixtures for the calibration tests: the task outbox captured instead of sent."""

from __future__ import annotations

import pytest


@pytest.fixture
def outbox(monkeypatch) -> list[tuple[str, list]]:
    """Tasks the services hand to the broker after commit, captured instead of sent."""
    sent: list[tuple[str, list]] = []
    monkeypatch.setattr("controlplane.outbox.send_task",
                        lambda name, args: sent.append((name, list(args))))
    return sent
