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
