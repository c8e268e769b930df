"""The deployment page says when per-token records are sampled (runtimes aggregating at the
edge), and the read API says it too."""

from __future__ import annotations

import time
import uuid

from sqlalchemy.orm import Session

from controlplane.deployments import service as thresholds
from controlplane.telemetry.service import ingest
from exitplane.wire import AggregateBatch, AggregateCell


def test_the_page_says_records_are_sampled(as_role, engine, seeded):
    viewer = as_role("viewer")
    page = viewer.get("/ui/deployments/chat")
    assert page.status_code == 200 and 'id="records-sampled"' not in page.text
    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name="chat")
        minute = int(time.time()) // 60 * 60
        ingest(session=session, deployment=deployment, batches=[AggregateBatch(
            batch_id=uuid.uuid4().hex, deployment="chat", runtime_id="rt-edge", seq=0,
            num_layers=deployment.num_layers, raw_sample_rate=0.01,
            cells=[AggregateCell(minute=minute, threshold_version=3, layer=layer, exits=10,
                                 histogram=[0] * 19 + [10])
                   for layer in deployment.exit_layers])])
        session.commit()
    page = viewer.get("/ui/deployments/chat")
    assert 'id="records-sampled"' in page.text
    assert "every shadow token plus 1.0% of the others" in page.text
