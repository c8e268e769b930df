"""Which segment a batch's traffic is stored under: the deployment's cap at ingest (issue 18).

Every name a stored batch carries goes through `admit_segments` (controlplane/thresholds/
segments.py) in the transaction that writes the batch: a name the deployment knows, or can
still register, is stored as itself (and registered there); any other is stored as `default`
(logged once per process here; every such token is counted by the callers that commit, in
`exitplane_segment_overflow_tokens_total`, from `IngestResult.overflow`).
Admission happens where batches are written (`service.ingest`), on the HTTP path and in the
Redis-stream ingest worker alike; the API's stream path checks batches without it (it reads
nothing from the store). A replayed batch adds nothing: its names were decided when it was
first stored, and the registry only grows, so deciding them again changes nothing.

Decisions are cached per process (per engine, per deployment), like IngestTargets caches
versions, so a batch whose names are all known reads nothing. A decision enters the cache only
when the transaction that made it commits: the registry only grows, so a committed "known" or
"over the cap" never changes, while one from a rolled-back transaction may not hold.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterable

from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

from controlplane.thresholds.segments import admit_segments
from exitplane.wire import DEFAULT_SEGMENT

log = logging.getLogger("exitplane.telemetry")

_PENDING = "exitplane.segment_admissions"  # session.info key: decisions awaiting the commit

# engine -> deployment id -> {name: stored name}; a new engine (another database) starts empty.
_decided: weakref.WeakKeyDictionary[Engine, dict[int, dict[str, str]]] = \
    weakref.WeakKeyDictionary()
_lock = threading.Lock()


def stored_segments(*, session: Session, deployment_id: int,
                    names: Iterable[str]) -> dict[str, str]:
    """Each of `names` -> the segment its traffic is stored under (itself or `default`);
    registers new names in the session's transaction. Reads nothing when every name was
    decided before in this process."""
    names = set(names)
    cached = _cache(session).get(deployment_id, {})
    if names <= cached.keys() | {DEFAULT_SEGMENT}:
        return {name: cached.get(name, name) for name in names}
    decided = admit_segments(session=session, deployment_id=deployment_id, names=names)
    session.info.setdefault(_PENDING, []).append((deployment_id, decided))
    return decided


def _cache(session: Session) -> dict[int, dict[str, str]]:
    bind = session.get_bind()
    engine = bind.engine if isinstance(bind, Connection) else bind
    with _lock:
        return _decided.setdefault(engine, {})


@event.listens_for(Session, "after_commit")
def _remember(session: Session) -> None:
    """The committed decisions enter the cache; a name kept out is logged once per process."""
    if session.in_nested_transaction():
        return  # a savepoint's commit: the enclosing transaction may still roll back
    pending = session.info.pop(_PENDING, None)
    if not pending:
        return
    cache = _cache(session)
    with _lock:
        for deployment_id, decided in pending:
            known = cache.setdefault(deployment_id, {})
            for name, stored in decided.items():
                if name in known or name == DEFAULT_SEGMENT:
                    continue
                known[name] = stored
                if stored != name:
                    log.warning("segment %r of deployment %d is stored as %r: the deployment "
                                "already knows EXITPLANE_MAX_SEGMENTS_PER_DEPLOYMENT segments",
                                name, deployment_id, stored)


@event.listens_for(Session, "after_rollback")
def _forget(session: Session) -> None:
    """A rolled-back transaction's decisions may not hold: they are decided again (after a
    savepoint's rollback too: which of them it undid is not known here)."""
    session.info.pop(_PENDING, None)
