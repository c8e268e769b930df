"""The deployment page lists the runtimes set aside as outliers with the evidence that set them
aside, and an operator's Clear form takes a runtime's evidence back (with a reason, audited)."""

from __future__ import annotations

import re

from sqlalchemy.orm import Session

from controlplane.deployments import service as thresholds
from controlplane.runtimes.outliers import excluded_runtime_ids, set_aside
from tests.support.people import csrf_of

EVIDENCE = {"statistic": "signal_above_median", "layer": 6, "runtime_rate": 0.211,
            "fleet_rate": 0.5, "z": -4.9, "p_value": 1.5e-10, "level": 6.9e-6, "tokens": 76,
            "requests": 10, "fleet_tokens": 1440, "fleet_requests": 180, "fleet_runtimes": 3}


def _outlier(engine, name: str) -> int:
    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name=name)
        record, created = set_aside(
            session=session, deployment=deployment, runtime_id="rt-liar", version=3,
            segment="default", summary="runtime rt-liar: share of signals above the fleet's "
            "median at layer 6 21.1% on 76 shadow tokens", evidence=EVIDENCE)
        assert created
        session.commit()
        return record.id


def _row(page: str, outlier_id: int) -> str:
    match = re.search(rf'<tr data-outlier="{outlier_id}".*?</tr>', page, re.S)
    assert match, f"no row for outlier {outlier_id}"
    return match.group(0)


def test_the_outlier_table_shows_the_evidence(as_role, engine, seeded):
    outlier_id = _outlier(engine, seeded.name)
    page = as_role("viewer").get(f"/ui/deployments/{seeded.name}").text
    assert 'id="outliers-title"' in page
    row = _row(page, outlier_id)
    assert "<code>rt-liar</code>" in row and "21.1% on 76 shadow tokens" in row
    assert "signal_above_median at layer 6" in row and "z -4.9" in row and "v3" in row
    assert "set aside" in row
    assert "/clear" not in row  # a viewer sees the record, not the form


def test_an_operator_clears_an_outlier_with_a_reason(as_role, engine, seeded):
    outlier_id = _outlier(engine, seeded.name)
    client = as_role("operator")
    page = f"/ui/deployments/{seeded.name}"
    path = f"{page}/outliers/{outlier_id}/clear"
    assert f'action="/ui/deployments/{seeded.name}/outliers/{outlier_id}/clear"' in _row(
        client.get(page).text, outlier_id)

    refused = client.post(path, data={"reason": "  ", "csrf_token": csrf_of(
        client.get(page).text)})
    assert "give a reason" in refused.text
    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name=seeded.name)
        assert "rt-liar" in excluded_runtime_ids(session=session, deployment_id=deployment.id)

    cleared = client.post(path, data={"reason": "runtime redeployed", "csrf_token": csrf_of(
        client.get(page).text)})
    assert cleared.status_code == 200
    assert "Runtime rt-liar cleared" in cleared.text
    row = _row(client.get(page).text, outlier_id)
    assert "cleared by" in row and "runtime redeployed" in row and "/clear" not in row
    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name=seeded.name)
        assert "rt-liar" not in excluded_runtime_ids(session=session,
                                                     deployment_id=deployment.id)
        last = thresholds.audit_log(session=session, deployment=deployment, limit=1)[0]
    assert last.action == "runtime.outlier_clear" and last.reason == "runtime redeployed"
    assert last.details["runtime_id"] == "rt-liar"

    again = client.post(path, data={"reason": "twice", "csrf_token": csrf_of(
        client.get(page).text)})
    assert "already cleared" in again.text
