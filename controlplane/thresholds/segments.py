"""The traffic segments a deployment knows (issue 18), capped so that the segment label's
cardinality stays bounded in the store, the gauges and the UI.

A name is registered the first time its traffic is stored or a threshold set names it, while
the deployment knows fewer than EXITPLANE_MAX_SEGMENTS_PER_DEPLOYMENT segments; traffic of any
other name is stored as `default` (and applies the default thresholds on the runtime, which
never had a map for it). `default` itself is always known and never registered.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controlplane.errors import Invalid
from controlplane.settings import get_settings
from controlplane.thresholds.locks import lock_deployment
from controlplane.thresholds.models import DeploymentSegment
from exitplane.wire import DEFAULT_SEGMENT


def known_segments(*, session: Session, deployment_id: int) -> list[str]:
    """The deployment's registered segments, sorted (`default` not included)."""
    return list(session.scalars(select(DeploymentSegment.name)
                                .where(DeploymentSegment.deployment_id == deployment_id)
                                .order_by(DeploymentSegment.name)))


def admit_segments(*, session: Session, deployment_id: int, names: Iterable[str],
                   limit: int | None = None) -> dict[str, str]:
    """Each of `names` -> the segment its traffic is stored under: itself when the deployment
    knows it or can still register it (registered here, in the caller's transaction), else
    `default`. New names are admitted in sorted order, so concurrent writers agree."""
    wanted = sorted(set(names) - {DEFAULT_SEGMENT})
    admitted = {DEFAULT_SEGMENT: DEFAULT_SEGMENT} if DEFAULT_SEGMENT in set(names) else {}
    if not wanted:
        return admitted
    known = set(known_segments(session=session, deployment_id=deployment_id))
    new = [name for name in wanted if name not in known]
    if new:
        if limit is None:
            limit = get_settings().max_segments_per_deployment
        # The deployment row lock serialises registrations, so the cap holds across writers
        # (FOR NO KEY UPDATE: two writers that inserted rows referencing the deployment would
        # deadlock on a plain FOR UPDATE; see locks.py).
        lock_deployment(session=session, deployment_id=deployment_id)
        known = set(known_segments(session=session, deployment_id=deployment_id))
        for name in new:
            if name not in known and len(known) < limit:
                session.add(DeploymentSegment(deployment_id=deployment_id, name=name))
                known.add(name)
        session.flush()
    return admitted | {name: name if name in known else DEFAULT_SEGMENT for name in wanted}


def register_set_segments(*, session: Session, deployment_id: int, names: Iterable[str],
                          limit: int | None = None) -> None:
    """Register the segments a threshold set names; Invalid when the deployment cannot take
    them all (a set's map for a segment whose traffic would be stored as `default` would
    never be checked against that traffic)."""
    names = sorted(set(names))
    admitted = admit_segments(session=session, deployment_id=deployment_id, names=names,
                              limit=limit)
    refused = [name for name in names if admitted[name] != name]
    if refused:
        count = session.scalar(select(func.count()).select_from(DeploymentSegment)
                               .where(DeploymentSegment.deployment_id == deployment_id))
        raise Invalid(f"the deployment already knows {count} segments, the most it may "
                      f"(EXITPLANE_MAX_SEGMENTS_PER_DEPLOYMENT); cannot add {refused}")
