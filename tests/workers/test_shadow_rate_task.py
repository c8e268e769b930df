"""`shadow_rate.decide_all` runs on a real worker: each deployment's rate is decided and
stored with its reason (a deployment without traffic: the highest its bounds allow; a fixed
one: its fixed rate)."""

from __future__ import annotations

from sqlalchemy.orm import Session

from controlplane.db import session_scope
from controlplane.deployments.service import get_deployment
from tests.support.calibration import make_deployment


def test_decide_all_runs_on_the_worker(engine, stack):
    app, _ = stack
    with session_scope(engine) as session:
        make_deployment(session)
        fixed = make_deployment(session, name="fixed")
        fixed.shadow_rate_min = fixed.shadow_rate_max = 0.07
    decided = app.send_task("shadow_rate.decide_all").get(timeout=120)
    assert decided == {"chat": 0.2, "fixed": 0.07}
    with Session(engine) as session:
        chat = get_deployment(session=session, name="chat")
        assert chat.shadow_rate == 0.2 and chat.shadow_rate_reason.startswith("no recent traffic")
        assert get_deployment(session=session, name="fixed").shadow_rate_reason == \
            "fixed by the operator at 0.07"
