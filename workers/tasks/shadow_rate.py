"""The shadow-rate task: beat decides every deployment's shadow rate at the drift interval."""

from __future__ import annotations

from celery import shared_task
from sqlalchemy import select

from controlplane.calibration.service import CalibrationPolicy
from controlplane.db import get_engine, session_scope
from controlplane.deployments.locks import lock_deployment
from controlplane.deployments.models import Deployment
from controlplane.drift.window_checks import DriftOptions
from controlplane.flows.shadow_rate import decide_for
from controlplane.settings import get_settings
from workers.tasks import RETRY_ON_STORE_ERRORS


@shared_task(name="shadow_rate.decide_all", **RETRY_ON_STORE_ERRORS)
def decide_all() -> dict[str, float]:
    """Decide and store each deployment's shadow rate (one short transaction each)."""
    settings = get_settings()
    options = DriftOptions.from_settings(settings)
    calibration = CalibrationPolicy.from_settings(settings)
    engine = get_engine(settings.effective_database_url)
    with session_scope(engine) as session:
        ids = list(session.scalars(select(Deployment.id).order_by(Deployment.id)))
    decided = {}
    for deployment_id in ids:
        with session_scope(engine) as session:
            # Under the row lock: an operator's change of bounds is not overwritten by a rate
            # decided within the bounds from before it.
            lock_deployment(session=session, deployment_id=deployment_id)
            deployment = session.get(Deployment, deployment_id)
            if deployment is None:
                continue
            decided[deployment.name] = decide_for(
                session=session, deployment=deployment, options=options,
                calibration=calibration, settings=settings).rate
    return decided
