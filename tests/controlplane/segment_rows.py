"""Segmented traffic in the store for the per-segment loop tests (issue 18).

The tests ingest each segment's tokens through the real ingestion, from a runtime id of its
own, with the segment on every record; until the ingestion stores a record's segment (the
seg-ingest branch), the rows it wrote are then labelled with that segment through the ORM
(rollups, histograms, shadow samples, records of that runtime), and the name is registered as
traffic would register it. Once the ingestion stores segments this relabelling changes nothing.
"""

from __future__ import annotations

from sqlalchemy import update
from sqlalchemy.orm import Session

from controlplane.telemetry.models import Rollup, RollupHistogram, ShadowSampleRow, TokenRecordRow
from controlplane.thresholds.models import Deployment
from controlplane.thresholds.segments import admit_segments


def label_segment(session: Session, deployment: Deployment, *, runtime_id: str,
                  segment: str) -> None:
    """Every stored row of `runtime_id` on `deployment` belongs to traffic segment `segment`."""
    admitted = admit_segments(session=session, deployment_id=deployment.id, names=[segment])
    assert admitted[segment] == segment, f"segment {segment} was not admitted"
    for model in (Rollup, RollupHistogram, ShadowSampleRow, TokenRecordRow):
        session.execute(update(model).where(model.deployment_id == deployment.id,
                                            model.runtime_id == runtime_id)
                        .values(segment=segment))
    session.flush()
