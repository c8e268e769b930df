"""A `last_good` fallback to a version with per-segment thresholds keeps its segment map
(raised by the margin like the default map): dropping it would send a segment whose own map is
stricter than default's back to default's looser thresholds in the middle of an incident."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy.orm import Session

from controlplane.db import session_scope, utcnow
from controlplane.deployments.service import (
    aliases_of,
    get_deployment,
    get_threshold_set,
    move_alias,
    publish,
    to_wire,
)
from tests.support.calibration import (
    BAD,
    GOOD,
    fire_alert,
    make_deployment,
    separable_samples,
    write_traffic,
)

CODE = {3: 1.0, 6: 0.97, 9: 0.9}


def test_last_good_keeps_and_raises_the_segment_map(engine, outbox):
    signals, matched = separable_samples(1000, seed=3)
    start = utcnow() - timedelta(hours=2)
    with session_scope(engine) as session:
        make_deployment(session, fallback_mode="last_good", fallback_margin=0.05)
        deployment = get_deployment(session=session, name="chat")
        good = publish(session=session, deployment=deployment, thresholds=GOOD,
                       segments={"code": CODE}, reason="per segment", actor="ops").version
        move_alias(session=session, deployment=deployment, alias="active", version=good,
                   actor="ops", reason="per segment")
        write_traffic(session, "chat", signals, matched, start=start, version=good,
                      thresholds=GOOD, shadow_every=2)
        bad = publish(session=session, deployment=deployment, thresholds=BAD,
                      reason="too aggressive", actor="ops").version
        move_alias(session=session, deployment=deployment, alias="active", version=bad,
                   actor="ops", reason="too aggressive")
        write_traffic(session, "chat", signals, matched, start=start + timedelta(hours=1),
                      version=bad, thresholds=BAD, shadow_every=2)
    fire_alert(engine)
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        active = aliases_of(session=session, deployment=deployment)["active"]
        fallback_set = get_threshold_set(session=session, deployment=deployment, version=active)
        assert fallback_set.origin == "fallback" and fallback_set.parent_version == good
        assert fallback_set.thresholds_by_layer() == pytest.approx({3: 0.95, 6: 0.85, 9: 0.75})
        assert fallback_set.segments_by_layer()["code"] == pytest.approx(
            {3: 1.0, 6: 1.0, 9: 0.95})
        to_wire(deployment=deployment, threshold_set=fallback_set).verify()
