"""Calibration pages: jobs with per-layer results and the curve, approve / reject through the
calibration services, start a recalibration."""

from __future__ import annotations

from sqlalchemy.orm import Session

from controlplane.calibration import service as calibration
from controlplane.deployments import service as thresholds
from tests.support.people import csrf_of


def _post(client, path: str, form: dict, page: str):
    return client.post(path, data={**form, "csrf_token": csrf_of(client.get(page).text)})


def _job(engine, job_id):
    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name="chat")
        job = calibration.get_job(session=session, deployment=deployment, job_id=job_id)
        active = thresholds.aliases_of(session=session, deployment=deployment)["active"]
        last = thresholds.audit_log(session=session, deployment=deployment, limit=1)[0]
    return job, active, last


def test_job_page_shows_results_curve_and_version(as_role, calibrated):
    viewer = as_role("viewer")
    listing = viewer.get("/ui/deployments/chat/calibrations").text
    assert f"/ui/deployments/chat/calibrations/{calibrated}" in listing
    assert "awaiting_approval" in listing and "v5" in listing
    page = viewer.get(f"/ui/deployments/chat/calibrations/{calibrated}").text
    assert 'data-figure-for="figure-curve"' in page and '"chosen"' in page
    assert "Disagreement bound" in page and "Per exit layer" in page
    assert "requests, tested per request (design effect" in page  # the request-level test
    assert "/ui/deployments/chat/versions#v5" in page
    assert "approve-reason" not in page  # viewers cannot decide


def test_approve_promotes_the_candidate(as_role, engine, calibrated):
    page = f"/ui/deployments/chat/calibrations/{calibrated}"
    response = _post(as_role("operator"), f"{page}/approve", {"reason": "looks right"}, page)
    assert "approved: it is active" in response.text
    job, active, event = _job(engine, calibrated)
    assert (job.promotion, job.decided_by, active) == ("approved", "user:operator", 5)
    assert event.action == "alias.promote" and "looks right" in event.reason


def test_reject_keeps_the_active_version(as_role, engine, calibrated):
    page = f"/ui/deployments/chat/calibrations/{calibrated}"
    client = as_role("operator")
    empty = _post(client, f"{page}/reject", {"reason": ""}, page)
    assert "give a reason" in empty.text
    response = _post(client, f"{page}/reject", {"reason": "too aggressive"}, page)
    assert "rejected" in response.text
    job, active, event = _job(engine, calibrated)
    assert (job.promotion, active, event.action) == ("rejected", 3, "candidate.reject")


def test_start_a_recalibration(as_role, engine, seeded, outbox):
    client = as_role("operator")
    page = "/ui/deployments/chat/calibrations"
    response = _post(client, page, {"hours": "6", "reason": "traffic shifted"}, page)
    assert "Recalibration job 1 queued on the last 6 h" in response.text
    again = _post(client, page, {"hours": "6", "reason": "again"}, page)
    assert "job 1 is already queued" in again.text
    assert outbox == [("calibration.run", [1])]  # handed to the workers once, after the commit
    job, _, _ = _job(engine, 1)
    assert (job.trigger, job.requested_by, job.reason) == (
        "manual", "user:operator", "traffic shifted")


def test_canary_actions_go_through_the_canary_service(as_role, engine, seeded):
    from controlplane.flows.canary import running_canary

    client = as_role("operator")
    versions = "/ui/deployments/chat/versions"
    started = _post(client, "/ui/deployments/chat/act/canary", {"version": "4"}, versions)
    assert "Canary started" in started.text and "Canary run #1: v4 vs v3" in started.text
    stopped = _post(client, "/ui/deployments/chat/act/canary-stop", {"reason": "enough"},
                    versions)
    assert "Canary stopped" in stopped.text
    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name="chat")
        run = running_canary(session=session, deployment=deployment)
        assert (run.status, run.status_reason) == ("reverted", "enough")
        assert "canary" not in thresholds.aliases_of(session=session, deployment=deployment)
