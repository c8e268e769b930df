"""Fixtures the security tests share (requested by name: tests/security/test_api_fuzz.py runs
without them)."""

from __future__ import annotations

import pytest


@pytest.fixture
def quick_hashing(monkeypatch):
    """Argon2 with minimal cost: these tests check who gets in, not the hash's strength."""
    from argon2 import PasswordHasher

    from controlplane.auth import users

    monkeypatch.setattr(users, "_hasher", PasswordHasher(time_cost=1, memory_cost=1024,
                                                         parallelism=1))


@pytest.fixture
def sent_tasks(monkeypatch) -> list[tuple[str, list]]:
    """Celery tasks handed over after commit, recorded instead of sent: no worker runs here,
    and the process-wide broker is not this test's database's."""
    from controlplane import outbox

    sent: list[tuple[str, list]] = []
    monkeypatch.setattr(outbox, "send_task", lambda name, args: sent.append((name, args)))
    return sent
