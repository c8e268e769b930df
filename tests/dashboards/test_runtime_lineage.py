"""The deployment page's runtime list shows each runtime's exit heads and model revision, marks
what differs from the deployment's, and which runtimes' evidence is set aside for it."""

from __future__ import annotations

import re

from sqlalchemy.orm import Session

from controlplane.deployments import service as thresholds
from controlplane.runtimes.service import record_heartbeat
from exitplane.wire import Heartbeat

HEADS = "c0ffee" + "0" * 58
OTHER_HEADS = "decade" + "1" * 58


def _row(page: str, runtime_id: str) -> str:
    match = re.search(rf'<tr data-runtime="{runtime_id}".*?</tr>', page, re.S)
    assert match, f"no row for {runtime_id}"
    return match.group(0)


def test_the_runtime_list_shows_heads_and_model(as_role, engine, seeded):
    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name=seeded.name)
        deployment.head_digest, deployment.model_revision = HEADS, "rev-7"
        session.flush()
        for runtime_id, heads, model in (("rt-a", HEADS, "rev-7"), ("rt-b", None, None),
                                         ("rt-c", OTHER_HEADS, "rev-7")):
            record_heartbeat(session=session, deployment=deployment, beat=Heartbeat(
                runtime_id=runtime_id, applied_version=3, head_digest=heads,
                model_revision=model))
        session.commit()
    page = as_role("viewer").get(f"/ui/deployments/{seeded.name}").text
    assert 'id="lineage-named"' in page and f'title="{HEADS}"' in page
    same, unknown, other = (_row(page, name) for name in ("rt-a", "rt-b", "rt-c"))
    assert f'title="{HEADS}"' in same and "rev-7" in same
    assert "differs" not in same and "other lineage" not in same
    assert unknown.count("unknown") == 2 and "other lineage" not in unknown
    assert f'title="{OTHER_HEADS}"' in other and other.count("differs") == 1
    assert "other lineage" in other and 'class="lineage-mismatch"' in other
