"""What checking a telemetry batch needs of its deployment, cached per API process.

On the production path (Redis configured) the API checks a batch and appends it to the stream;
the store is written by the ingest worker. The check needs the deployment's id, name, layer
count and exit layers, which never change once the deployment exists, and the versions ever
published for it, which only grow (a threshold set is never deleted). So the cache needs no
expiry: a batch naming a version the cache does not know reloads the entry once, and only a
version the store does not have either is refused. At fleet scale this takes the two store
reads (and the session) off every telemetry request.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from controlplane.thresholds.models import ThresholdSet
from controlplane.thresholds.service import get_deployment


@dataclass(frozen=True)
class IngestTarget:
    """A deployment as the batch checks see it (`check_batch`, `check_aggregate`)."""

    id: int
    name: str
    num_layers: int
    exit_layers: tuple[int, ...]
    versions: frozenset[int]  # published versions, and 0 (the runtime's built-in set)


class IngestTargets:
    """Per-process cache of `IngestTarget` by deployment name (thread-safe)."""

    def __init__(self, session_factory: sessionmaker[Session]) -> None:
        self._session_factory = session_factory
        self._targets: dict[str, IngestTarget] = {}
        self._lock = threading.Lock()  # one reload at a time: a burst costs one store read

    def get(self, name: str, versions: Iterable[int]) -> IngestTarget:
        """The deployment `name` with every version of `versions` it has; reads the store
        only when it is not cached or a version is not known yet (NotFound if it does not
        exist)."""
        wanted = set(versions)
        target = self._targets.get(name)
        if target is not None and wanted <= target.versions:
            return target
        with self._lock:
            target = self._targets.get(name)  # another thread may have reloaded it meanwhile
            if target is None or not wanted <= target.versions:
                target = self._targets[name] = self._load(name)
        return target

    def peek(self, name: str, versions: Iterable[int]) -> IngestTarget | None:
        """The cached target if it knows every version of `versions`; never reads the store
        (for the event loop: None sends the caller to `get` on a worker thread)."""
        target = self._targets.get(name)
        return target if target is not None and set(versions) <= target.versions else None

    def _load(self, name: str) -> IngestTarget:
        with self._session_factory() as session:
            deployment = get_deployment(session=session, name=name)
            versions = session.scalars(select(ThresholdSet.version).where(
                ThresholdSet.deployment_id == deployment.id))
            return IngestTarget(id=deployment.id, name=deployment.name,
                                num_layers=deployment.num_layers,
                                exit_layers=tuple(deployment.exit_layers),
                                versions=frozenset([0, *versions]))
