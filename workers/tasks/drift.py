"""Drift detection tasks: one deployment per task, fanned out by beat every 30 s."""

from __future__ import annotations

from celery import shared_task
from sqlalchemy import select

from controlplane.db import get_engine, session_scope
from controlplane.deployments.models import Deployment
from controlplane.drift.service import DriftOptions, check_deployment, check_runtimes
from controlplane.runtimes.lineage import check_lineage
from controlplane.settings import get_settings
from workers.tasks import RETRY_ON_STORE_ERRORS


def _summary(result) -> dict:
    return {"fired": [a.id for a in result.fired], "refreshed": [a.id for a in result.refreshed],
            "resolved": [a.id for a in result.resolved]}


@shared_task(name="drift.detect", **RETRY_ON_STORE_ERRORS)
def detect(deployment_id: int) -> dict:
    """Check one deployment's exit behaviour; fire, refresh or resolve its alerts."""
    settings = get_settings()
    with session_scope(get_engine(settings.effective_database_url)) as session:
        deployment = session.get(Deployment, deployment_id)
        if deployment is None:
            return {"skipped": f"deployment {deployment_id} no longer exists"}
        result = check_deployment(session=session, deployment=deployment,
                                  options=DriftOptions.from_settings(settings),
                                  keep_reports=True)
        return _summary(result)


@shared_task(name="drift.detect_all", **RETRY_ON_STORE_ERRORS)
def detect_all() -> list[int]:
    """Queue `drift.detect` for every deployment (the beat entry)."""
    settings = get_settings()
    with session_scope(get_engine(settings.effective_database_url)) as session:
        ids = list(session.scalars(select(Deployment.id).order_by(Deployment.id)))
    for deployment_id in ids:
        detect.apply_async(args=[deployment_id], expires=settings.drift_interval_s)
    return ids


@shared_task(name="runtimes.check_stale", **RETRY_ON_STORE_ERRORS)
def check_stale(deployment_id: int | None = None) -> dict:
    """Alert on runtimes that stopped heartbeating or apply an old version (`runtime_stale`)
    and on runtimes serving other heads or another model (`runtime_mismatch`), for all
    deployments unless one id is given."""
    settings = get_settings()
    out = {}
    with session_scope(get_engine(settings.effective_database_url)) as session:
        query = select(Deployment).order_by(Deployment.id)
        if deployment_id is not None:
            query = query.where(Deployment.id == deployment_id)
        for deployment in session.scalars(query):
            result = check_runtimes(session=session, deployment=deployment,
                                    stale_after_s=settings.runtime_stale_after_s,
                                    clear_after_s=settings.alert_clear_after_s)
            mismatch = check_lineage(session=session, deployment=deployment,
                                     clear_after_s=settings.alert_clear_after_s)
            out[deployment.name] = {key: value + _summary(mismatch)[key]
                                    for key, value in _summary(result).items()}
    return out
