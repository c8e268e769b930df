"""Fixtures the security tests share (requested by name: tests/security/test_api_fuzz.py runs
without them); quick_hashing is tests/conftest.py's."""

from __future__ import annotations

import pytest


@pytest.fixture
def sent_tasks(monkeypatch) -> list[tuple[str, list]]:
    """Celery tasks handed over after commit, recorded instead of sent: no worker runs here,
    and the process-wide broker is not this test's database's."""
    from controlplane.alerts import service as outbox

    sent: list[tuple[str, list]] = []
    monkeypatch.setattr(outbox, "send_task", lambda name, args: sent.append((name, args)))
    return sent
