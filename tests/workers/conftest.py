"""Worker tests share the alert tests' real HTTP receiver."""

from tests.controlplane.alerts.conftest import receiver

__all__ = ["receiver"]
