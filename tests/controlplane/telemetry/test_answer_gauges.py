"""/metrics exports the answer gauges from the store: how many complete shadow requests of the
active version the last hour holds and the share whose whole answer under the active set (each
request under its segment's thresholds) is the full-depth answer, for the whole deployment
(segment="") and each registered segment; nothing for a deployment without shadow requests."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
from sqlalchemy.orm import Session

from controlplane.db import utcnow
from controlplane.deployments.segments import admit_segments
from controlplane.telemetry.service import ingest
from exitplane.wire import TelemetryBatch
from tests.support.alerts import FULL, LAYERS, make_deployment
from tests.support.batches import telemetry_batch
from tests.support.shadow_requests import shadow_request_records

SEGMENT_GAUGES = ("exitplane_shadow_requests", "exitplane_answer_identical_share")


def _records(outcomes, *, start: float, segment: str, version: int = 2,
             prefix: str = "") -> list[dict]:
    """One 5-token shadow request per outcome (True: under thresholds 4: 0.9 its token 2 exits
    at layer 4 with a mismatched prediction, so its answer differs)."""
    records = []
    for i, differs in enumerate(outcomes):
        signals = np.full((5, len(LAYERS)), 0.5, dtype=np.float32)
        matched = np.ones(signals.shape, dtype=bool)
        if differs:
            signals[2, 0], matched[2, 0] = 0.95, False
        records += shadow_request_records(
            signals, matched, request_id=f"{prefix}{segment}-{version}-{i}", start=start + i,
            version=version, segment=None if segment == "default" else segment,
            layers=LAYERS, num_layers=FULL)
    return records


def _samples(text: str, name: str) -> dict[tuple[str, str], float]:
    """{(deployment, segment): value} of one family's samples."""
    import re

    found = {}
    for line in text.splitlines():
        match = re.match(rf'^{name}\{{deployment="([^"]*)",segment="([^"]*)"\}} (\S+)$', line)
        if match:
            found[match.group(1), match.group(2)] = float(match.group(3))
    return found


@pytest.fixture
def answered(engine) -> None:
    """`mix` knows segment code: 8 default requests (2 differ), 4 code ones (3 differ), and 5
    of an older version that do not count; `quiet` has no shadow requests."""
    start = (utcnow() - timedelta(minutes=10)).timestamp()
    with Session(engine) as session:
        mix = make_deployment(session, "mix")
        admit_segments(session=session, deployment_id=mix.id, limit=4, auto=True,
                       names=["code"])
        records = (_records([i < 2 for i in range(8)], start=start, segment="default")
                   + _records([i < 3 for i in range(4)], start=start, segment="code")
                   + _records([True] * 5, start=start, segment="default", version=1))
        ingest(session=session, deployment=mix, batches=[TelemetryBatch.model_validate(
            telemetry_batch(records, deployment="mix", runtime_id="rt-1", num_layers=FULL))])
        make_deployment(session, "quiet")
        session.commit()


def test_answer_gauges_per_deployment_and_segment(client, answered):
    scrape = client.get("/metrics").text
    requests = _samples(scrape, "exitplane_shadow_requests")
    identical = _samples(scrape, "exitplane_answer_identical_share")
    assert requests == {("mix", ""): 12, ("mix", "default"): 8, ("mix", "code"): 4}
    assert identical[("mix", "")] == pytest.approx(7 / 12)
    assert identical[("mix", "default")] == pytest.approx(6 / 8)
    assert identical[("mix", "code")] == pytest.approx(1 / 4)
    assert not any(deployment == "quiet" for deployment, _ in requests | identical)


def test_one_witness_moves_the_answer_gauges_no_more_than_its_share(client, engine):
    """rt-flood sends 30 differing answers, rt-a and rt-b 6 identical ones each: with each
    witness cut to half of the requests at most (EXITPLANE_EVIDENCE_MAX_RUNTIME_SHARE 0.5),
    the flood keeps 12 of its 30 and the gauge reads 12 identical of 24, not 12 of 42."""
    start = (utcnow() - timedelta(minutes=10)).timestamp()
    with Session(engine) as session:
        flooded = make_deployment(session, "flooded")
        for runtime, outcomes in (("rt-flood", [True] * 30), ("rt-a", [False] * 6),
                                  ("rt-b", [False] * 6)):
            records = _records(outcomes, start=start, segment="default", prefix=runtime)
            ingest(session=session, deployment=flooded, batches=[TelemetryBatch.model_validate(
                telemetry_batch(records, deployment="flooded", runtime_id=runtime,
                                num_layers=FULL))])
        session.commit()
    scrape = client.get("/metrics").text
    assert _samples(scrape, "exitplane_shadow_requests")[("flooded", "")] == 24
    assert _samples(scrape, "exitplane_answer_identical_share")[("flooded", "")] == \
        pytest.approx(12 / 24)
