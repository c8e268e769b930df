"""Operating-curve tasks: thin, named, idempotent; the flow does the work
(`controlplane.flows.operating_curve`).

`curve.refresh_all` (the beat entry, every EXITPLANE_OPERATING_CURVE_INTERVAL_S) queues
`curve.refresh` per deployment, which draws and stores each segment's operating curve, raises
or clears the `opportunity` finding, queues an opportunity recalibration (one per opportunity)
and the scheduled one when due. Drawing the curve again over the same window stores the same
row again: a redelivered task changes nothing.
"""

from __future__ import annotations

from celery import shared_task
from sqlalchemy import select

from controlplane.db import get_engine, session_scope
from controlplane.deployments.models import Deployment
from controlplane.flows.operating_curve import refresh_deployment
from controlplane.settings import get_settings
from workers.tasks import RETRY_ON_STORE_ERRORS


@shared_task(name="curve.refresh", **RETRY_ON_STORE_ERRORS)
def refresh(deployment_id: int) -> dict:
    """Draw one deployment's operating curves, check them for an opportunity, and queue its
    scheduled recalibration when due."""
    settings = get_settings()
    with session_scope(get_engine(settings.effective_database_url)) as session:
        deployment = session.get(Deployment, deployment_id)
        if deployment is None:
            return {"skipped": f"deployment {deployment_id} no longer exists"}
        return refresh_deployment(session=session, deployment=deployment, settings=settings)


@shared_task(name="curve.refresh_all", **RETRY_ON_STORE_ERRORS)
def refresh_all() -> list[int]:
    """Queue `curve.refresh` for every deployment (the beat entry)."""
    settings = get_settings()
    with session_scope(get_engine(settings.effective_database_url)) as session:
        ids = list(session.scalars(select(Deployment.id).order_by(Deployment.id)))
    for deployment_id in ids:
        refresh.apply_async(args=[deployment_id], expires=settings.operating_curve_interval_s)
    return ids
