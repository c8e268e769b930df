"""The trust rules every read of shadow evidence applies (docs/concepts/witnesses.md), written
once for the tables that hold evidence: shadow samples (`ShadowSampleRow`) and shadow requests
(`ShadowRequestRow`), which share the columns the rules read (deployment, runtime, witness,
threshold version, arrival delay)."""

from __future__ import annotations

from collections.abc import Collection

from sqlalchemy import Select, exists, or_
from sqlalchemy.orm import Session

from controlplane.runtimes.models import RuntimeVersion
from controlplane.runtimes.outliers import excluded_runtime_ids, excluded_witnesses
from controlplane.runtimes.witnesses import TOKEN_PREFIX
from controlplane.settings import get_settings


def trusted(query: Select, model, *, session: Session, deployment_id: int,
            exclude: Collection[str] | None = None,
            exclude_witnesses: Collection[str] | None = None) -> Select:
    """`query` over `model` without the runtimes in `exclude` and the witnesses in
    `exclude_witnesses` (None: the deployment's set aside as outliers or serving other heads
    or another model, `runtimes.outliers`; (): none), without a runtime token's evidence at a
    version its runtime never said it applied, and without evidence a runtime token posted
    implausibly long after its own timestamp (settings: evidence_max_delay_s)."""
    if exclude is None:
        exclude = excluded_runtime_ids(session=session, deployment_id=deployment_id)
    if exclude_witnesses is None:
        exclude_witnesses = excluded_witnesses(session=session, deployment_id=deployment_id)
    if exclude:
        query = query.where(model.runtime_id.not_in(sorted(exclude)))
    if exclude_witnesses:
        query = query.where(model.witness.not_in(sorted(exclude_witnesses)))
    # a runtime token's evidence counts at versions its runtime said it applied (or 0)
    applied = exists().where(RuntimeVersion.deployment_id == model.deployment_id,
                             RuntimeVersion.runtime_id == model.runtime_id,
                             RuntimeVersion.version == model.threshold_version)
    query = query.where(or_(~model.witness.startswith(TOKEN_PREFIX),
                            model.threshold_version == 0, applied))
    # evidence a runtime token posted long after its own timestamp is not taken (backdating)
    return query.where(or_(model.arrival_delay_s.is_(None),
                           model.arrival_delay_s <= get_settings().evidence_max_delay_s,
                           ~model.witness.startswith(TOKEN_PREFIX)))
