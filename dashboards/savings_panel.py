"""The savings panel's context (dashboards/templates/_savings.html): what early exit saved over
the page's window, from the rollups (`telemetry.savings`), for one deployment or the fleet.

A bounded read: one grouped rollup query per page over at most the page's window."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy.orm import Session

from controlplane.db import utcnow
from controlplane.deployments.models import Deployment
from controlplane.settings import Settings
from controlplane.telemetry.savings import fleet_total, savings


def savings_panel(*, session: Session, deployments: list[Deployment], minutes: int,
                  settings: Settings, segment: str | None = None, fleet: bool = False) -> dict:
    """`reports` (one per deployment), `total` (the fleet's, when `fleet`) and the window."""
    reports = savings(session=session, deployments=deployments, settings=settings,
                      since=utcnow() - timedelta(minutes=minutes), segment=segment)
    return {"reports": reports, "total": fleet_total(reports, settings) if fleet else None,
            "minutes": minutes, "segment": segment, "fleet": fleet}
