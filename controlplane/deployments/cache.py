"""The deployment cache: what request-time checks (telemetry batches, heartbeats, token scopes)
need of a deployment, held per API process.

On the production path (Redis configured) the API checks a batch and appends it to the stream;
the store is written by the ingest worker. The check needs the deployment's id, name, layer
count and exit layers, which never change once the deployment exists, and the versions ever
published for it, which only grow (a threshold set is never deleted). So the cache needs no
expiry: a batch naming a version the cache does not know reloads the entry once, and only a
version the store does not have either is refused. A config notification of a name (sent when
its aliases move, and when it is deleted) drops its entry, so a name deleted and created again
is never checked against the old id. At fleet scale this takes the two store reads (and the
session) off every telemetry request.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from controlplane.deployments.models import ThresholdSet
from controlplane.deployments.service import get_deployment


@dataclass(frozen=True)
class CachedDeployment:
    """A deployment as the batch checks see it (`check_batch`, `check_aggregate`)."""

    id: int
    name: str
    num_layers: int
    exit_layers: tuple[int, ...]
    versions: frozenset[int]  # published versions, and 0 (the runtime's built-in set)


class DeploymentCache:
    """Per-process cache of `CachedDeployment` by deployment name (thread-safe)."""

    def __init__(self, session_factory: sessionmaker[Session]) -> None:
        self._session_factory = session_factory
        self._entries: dict[str, CachedDeployment] = {}
        self._lock = threading.Lock()  # one reload at a time: a burst costs one store read

    def get(self, name: str, versions: Iterable[int]) -> CachedDeployment:
        """The deployment `name` with every version of `versions` it has; reads the store
        only when it is not cached or a version is not known yet (NotFound if it does not
        exist)."""
        wanted = set(versions)
        entry = self._entries.get(name)
        if entry is not None and wanted <= entry.versions:
            return entry
        with self._lock:
            entry = self._entries.get(name)  # another thread may have reloaded it meanwhile
            if entry is None or not wanted <= entry.versions:
                entry = self._entries[name] = self._load(name)
        return entry

    def peek(self, name: str, versions: Iterable[int]) -> CachedDeployment | None:
        """The cached entry if it knows every version of `versions`; never reads the store
        (for the event loop: None sends the caller to `get` on a worker thread)."""
        entry = self._entries.get(name)
        return entry if entry is not None and set(versions) <= entry.versions else None

    def forget(self, name: str | None) -> None:
        """Drop the entry of deployment `name` (None: every entry); a bus listener."""
        with self._lock:
            if name is None:
                self._entries.clear()
            else:
                self._entries.pop(name, None)

    def _load(self, name: str) -> CachedDeployment:
        with self._session_factory() as session:
            deployment = get_deployment(session=session, name=name)
            versions = session.scalars(select(ThresholdSet.version).where(
                ThresholdSet.deployment_id == deployment.id))
            return CachedDeployment(id=deployment.id, name=deployment.name,
                                    num_layers=deployment.num_layers,
                                    exit_layers=tuple(deployment.exit_layers),
                                    versions=frozenset([0, *versions]))
