"""Drift detector tests share the alert fixtures (captured outbox, real HTTP receiver)."""

from tests.controlplane.alerts.conftest import outbox, receiver

__all__ = ["outbox", "receiver"]
