"""Which segment a batch's traffic is stored under, decided where batches are written
(`service.ingest`), on the HTTP path and in the Redis-stream ingest worker alike.

A name the deployment has in use (controlplane/deployments/segments.py) is stored as itself; any
other as `default`, unless the deployment opted in to registering names from telemetry
(`auto_segments`) and its registry has room, when `admit_segments` registers it in the
transaction that writes the batch. Tokens stored as `default` this way are counted by the
callers (`IngestResult.overflow`: the store's undeclared_segment_tokens and the metric
`exitplane_segment_overflow_tokens_total`) and logged here at most once per deployment every
LOG_EVERY_S seconds, with counts, however many names they carried.

What each deployment has in use is cached per process (per engine, per deployment): the names
in use, the removed ones and the opt-in, never the names traffic merely carried, so the cache
is bounded by the deployments and the registry cap whatever the traffic sends. An entry is read
again after FRESH_S seconds (an operator's declaration or removal in another process takes
effect within that), and at once in the process whose transaction changed the registry, when
that transaction commits.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import event, select
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

from controlplane.deployments.models import Deployment, DeploymentSegment
from controlplane.deployments.segments import REGISTRY_CHANGED, admit_segments
from controlplane.errors import Invalid
from controlplane.settings import get_settings
from exitplane.wire import DEFAULT_SEGMENT

log = logging.getLogger("exitplane.telemetry")

FRESH_S = 2.0  # how long a process trusts what it read of a deployment's registry
LOG_EVERY_S = 60.0  # at most one log line per deployment this often about undeclared names
_UNDECLARED = "exitplane.undeclared_segments"  # session.info key: counts awaiting the commit


@dataclass(frozen=True)
class _Registry:
    """What one deployment has in use, as one process read it."""

    in_use: frozenset[str]
    removed: frozenset[str]
    auto: bool
    read_at: float  # time.monotonic()


@dataclass
class _Undeclared:
    """Tokens of one deployment stored as `default` since its last log line."""

    tokens: int = 0
    batches: int = 0
    widest: int = 0  # the most undeclared names one batch carried
    example: str = ""
    logged_at: float = -math.inf


# engine -> deployment id -> its registry; a new engine (another database) starts empty.
_registries: weakref.WeakKeyDictionary[Engine, dict[int, _Registry]] = \
    weakref.WeakKeyDictionary()
_undeclared: dict[int, _Undeclared] = {}  # deployment id -> counts since the last log line
_lock = threading.Lock()


def names_per_batch_limit() -> int:
    """The distinct segment names one batch may carry: what one runtime can send honestly,
    the names it tracks (EXITPLANE_MAX_SEGMENTS_PER_DEPLOYMENT) and those the applied set
    maps (as many), and `default`."""
    return 2 * get_settings().max_segments_per_deployment + 1


def check_segment_names(names: set[str], limit: int | None = None) -> None:
    """Invalid when a batch carries more distinct segment names than a runtime can."""
    limit = names_per_batch_limit() if limit is None else limit
    if len(names) > limit:
        raise Invalid(f"the batch carries {len(names)} distinct segment names; a batch may "
                      f"carry at most {limit} (twice EXITPLANE_MAX_SEGMENTS_PER_DEPLOYMENT, "
                      "and 'default'): name a request's segment from a small, fixed set")


def stored_segments(*, session: Session, deployment_id: int,
                    names: Iterable[str]) -> dict[str, str]:
    """Each of `names` -> the segment its traffic is stored under (itself or `default`);
    registers new names in the session's transaction where the deployment opted in. Reads
    nothing when this process read the registry within FRESH_S and nothing can be
    registered."""
    names = set(names)
    registry = _registry(session, deployment_id)
    unknown = names - registry.in_use - {DEFAULT_SEGMENT}
    if (unknown - registry.removed and registry.auto
            and len(registry.in_use) < get_settings().max_segments_per_deployment):
        return admit_segments(session=session, deployment_id=deployment_id, names=names,
                              auto=True)
    return {name: DEFAULT_SEGMENT if name in unknown else name for name in names}


def note_undeclared(*, session: Session, deployment_id: int, names: Iterable[str],
                    tokens: int) -> None:
    """One stored batch's names not in use (stored as `default`) and its tokens among them:
    logged after the commit, at most once per deployment every LOG_EVERY_S seconds."""
    names = sorted(names)
    if names:
        session.info.setdefault(_UNDECLARED, []).append(
            (deployment_id, len(names), names[0], tokens))


def _registry(session: Session, deployment_id: int) -> _Registry:
    cache = _cache(session)
    registry = cache.get(deployment_id)
    if registry is not None and time.monotonic() - registry.read_at < FRESH_S:
        return registry
    auto = session.scalar(select(Deployment.auto_segments)
                          .where(Deployment.id == deployment_id))
    rows = session.execute(select(DeploymentSegment.name, DeploymentSegment.removed_at)
                           .where(DeploymentSegment.deployment_id == deployment_id)).all()
    registry = _Registry(in_use=frozenset(name for name, removed in rows if removed is None),
                         removed=frozenset(name for name, removed in rows if removed),
                         auto=bool(auto), read_at=time.monotonic())
    # A transaction that changed this registry reads its own changes, not yet everyone's.
    if deployment_id not in session.info.get(REGISTRY_CHANGED, ()):
        with _lock:
            cache[deployment_id] = registry
    return registry


def _cache(session: Session) -> dict[int, _Registry]:
    bind = session.get_bind()
    engine = bind.engine if isinstance(bind, Connection) else bind
    with _lock:
        return _registries.setdefault(engine, {})


@event.listens_for(Session, "after_commit")
def _committed(session: Session) -> None:
    """A committed registry change is read again here at once; undeclared names are logged."""
    if session.in_nested_transaction():
        return  # a savepoint's commit: the enclosing transaction may still roll back
    changed = session.info.pop(REGISTRY_CHANGED, None)
    if changed:
        cache = _cache(session)
        with _lock:
            for deployment_id in changed:
                cache.pop(deployment_id, None)
    pending = session.info.pop(_UNDECLARED, None)
    if pending:
        _log_undeclared(pending)


def _log_undeclared(pending: list[tuple[int, int, str, int]]) -> None:
    now = time.monotonic()
    due = []
    with _lock:
        for deployment_id, count, example, tokens in pending:
            counts = _undeclared.setdefault(deployment_id, _Undeclared())
            counts.tokens += tokens
            counts.batches += 1
            if count >= counts.widest:
                counts.widest, counts.example = count, example
            if now - counts.logged_at >= LOG_EVERY_S:
                due.append((deployment_id, counts.tokens, counts.batches, counts.widest,
                            counts.example))
                _undeclared[deployment_id] = _Undeclared(logged_at=now)
    for deployment_id, tokens, batches, widest, example in due:
        log.warning("deployment %d: %d tokens in %d batches were stored as segment 'default' "
                    "since the last such line: their segments are not in use (up to %d such "
                    "names in one batch, e.g. %r); declare the ones you want (exitplane "
                    "segments declare)", deployment_id, tokens, batches, widest, example)


@event.listens_for(Session, "after_rollback")
def _rolled_back(session: Session) -> None:
    """A rolled-back transaction changed nothing and stored nothing."""
    session.info.pop(REGISTRY_CHANGED, None)
    session.info.pop(_UNDECLARED, None)
