"""Segments are the operator's. Anyone could fill a deployment's segment registry for ever: the
first 16 names any stored batch carried were registered, including names an anonymous caller put
in a runtime server's X-Exitplane-Segment header (runtime API keys are off by default); the
operator then got 422 publishing a real segment and could not remove the squatters.

Now a runtime server without API keys never passes a request's own name on, the control plane
stores names nobody declared as `default` (counted, per runtime) unless the deployment opted in,
and an operator removes a squatter (API, CLI, UI) and publishes the real segment; the removed
segment's stored traffic stays readable."""

from __future__ import annotations

import random
import tempfile
import time

import httpx
import pytest
from click.testing import CliRunner
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controlplane.auth.service import create_token
from controlplane.deployments.segments import known_segments
from controlplane.deployments.service import get_deployment
from controlplane.settings import get_settings
from controlplane.telemetry.models import TokenRecordRow
from exitplane.cli import main
from tests.support.batches import telemetry_batch
from tests.support.deployments import FULL, LAYERS, deploy_for_telemetry
from tests.support.people import create_people, csrf_of, sign_in
from tests.support.waiting import patient_get

SQUATTERS = [f"squat{index:02d}" for index in range(16)]  # the default cap
CODE_SET = {"thresholds": {"3": 0.9, "6": 0.8, "9": 0.7}, "reason": "code exits less",
            "segments": {"code": {"3": 1.0, "6": 0.95, "9": 0.9}}}


@pytest.fixture
def sign_in_as(app, engine, quick_hashing):
    """The admin UI on https://testserver (Secure cookies round-trip): signs in as a role."""
    from fastapi.testclient import TestClient

    create_people(engine)
    with TestClient(app, base_url="https://testserver") as ui:
        def signed(role: str):
            assert sign_in(ui, role).status_code == 200
            return ui

        yield signed


def _stored_by_segment(engine, deployment: str) -> dict[str, int]:
    with Session(engine) as session:
        deployment_id = get_deployment(session=session, name=deployment).id
        return dict(session.execute(
            select(TokenRecordRow.segment, func.count())
            .where(TokenRecordRow.deployment_id == deployment_id)
            .group_by(TokenRecordRow.segment)).all())


def _traffic(names: list[str], seq: int = 0, per_name: int = 3) -> dict:
    """A runtime's record batch with `per_name` tokens of each segment in `names`."""
    rng, now = random.Random(seq), time.time()
    records = [{"threshold_version": 2, "request_id": f"r{i}", "position": 0,
                "exit_layer": rng.choice([*LAYERS, FULL]), "signal_value": rng.random(),
                "latency_us": 100, "ts": now, "segment": name}
               for i, name in enumerate(name for name in names for _ in range(per_name))]
    return telemetry_batch(records, runtime_id="rt-squat", seq=seq)


def test_undeclared_names_are_stored_as_default_and_counted(client, tokens, engine):
    runtime = deploy_for_telemetry(client, tokens, engine)
    op = tokens.headers(tokens.operator)
    answer = client.post("/v1/telemetry", json=_traffic(SQUATTERS), headers=runtime)
    assert answer.status_code == 202, answer.text
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        assert known_segments(session=session, deployment_id=deployment.id) == []
    assert _stored_by_segment(engine, "chat") == {"default": 3 * len(SQUATTERS)}
    registry = client.get("/v1/deployments/chat/declared-segments", headers=op).json()
    assert registry["segments"] == [] and registry["auto_segments"] is False
    assert registry["undeclared_tokens"] == 3 * len(SQUATTERS)
    assert [(r["runtime_id"], r["tokens"], r["batches"])
            for r in registry["undeclared_by_runtime"]] == [("rt-squat", 48, 1)]
    # the operator's publication of the real segment goes through
    published = client.post("/v1/deployments/chat/threshold-sets", headers=op, json=CODE_SET)
    assert published.status_code == 201, published.text


def test_an_operator_removes_a_squatter_and_publishes_the_real_segment(client, tokens, engine):
    runtime = deploy_for_telemetry(client, tokens, engine)
    op = tokens.headers(tokens.operator)
    # A deployment that registers names from telemetry: a runtime token filled the registry.
    client.patch("/v1/deployments/chat", headers=op, json={"auto_segments": True})
    assert client.post("/v1/telemetry", json=_traffic(SQUATTERS),
                       headers=runtime).status_code == 202
    report = client.get("/v1/deployments/chat/segments", headers=op).json()
    assert [s["segment"] for s in report["segments"]] == ["default", *SQUATTERS]
    full = client.post("/v1/deployments/chat/threshold-sets", headers=op, json=CODE_SET)
    assert full.status_code == 422
    assert "EXITPLANE_MAX_SEGMENTS_PER_DEPLOYMENT" in full.json()["detail"]

    removed = client.delete("/v1/deployments/chat/declared-segments/squat00", headers=op,
                            params={"reason": "not a segment of ours"})
    assert removed.status_code == 200, removed.text
    assert removed.json()["removed_at"] is not None
    published = client.post("/v1/deployments/chat/threshold-sets", headers=op, json=CODE_SET)
    assert published.status_code == 201, published.text
    # what squat00 sent stays readable under its name ...
    history = patient_get(client, "/v1/deployments/chat/telemetry/exit-rates", headers=op,
                          params={"segment": "squat00"})
    assert history.status_code == 200 and sum(row["tokens"] for row in history.json()
                                              if row["layer"] == LAYERS[0]) == 3
    # ... its new traffic is `default`'s, and telemetry cannot register it again
    assert client.post("/v1/telemetry", json=_traffic(["squat00"], seq=1),
                       headers=runtime).status_code == 202
    assert _stored_by_segment(engine, "chat")["squat00"] == 3
    names = [s["name"] for s in client.get("/v1/deployments/chat/declared-segments",
                                           headers=op).json()["segments"]
             if s["removed_at"] is None]
    assert "squat00" not in names and "code" in names
    audit = patient_get(client, "/v1/deployments/chat/audit", headers=op).json()
    assert any(e["action"] == "segment.remove" and e["reason"] == "not a segment of ours"
               for e in audit)


def test_operators_declare_and_remove_from_the_cli_and_the_ui(client, tokens, engine, db_url,
                                                                 tmp_path, monkeypatch,
                                                                 sign_in_as):
    deploy_for_telemetry(client, tokens, engine)
    monkeypatch.setenv("EXITPLANE_DATABASE_URL", db_url)
    monkeypatch.setenv("EXITPLANE_VAR_DIR", str(tmp_path / "var"))
    get_settings.cache_clear()
    try:
        cli = CliRunner()
        declared = cli.invoke(main, ["segment", "declare", "--deployment", "chat", "code"])
        assert declared.exit_code == 0, declared.output
        listed = cli.invoke(main, ["segment", "list", "--deployment", "chat"])
        assert listed.exit_code == 0 and listed.stdout.startswith("code\tin use\toperator\t")
        refused = cli.invoke(main, ["segment", "remove", "--deployment", "chat", "nope"])
        assert refused.exit_code == 2 and "no segment 'nope' in use" in refused.output
    finally:
        get_settings.cache_clear()

    operator = sign_in_as("operator")
    page = operator.get("/ui/deployments/chat/segments")
    assert page.status_code == 200 and 'data-segment="code" class="in-use"' in page.text
    token = csrf_of(page.text)
    declared = operator.post("/ui/deployments/chat/segments", data={
        "csrf_token": token, "segment": "chat", "reason": "the chat product"})
    assert declared.status_code == 200 and "Segment chat is in use" in declared.text
    page = operator.post("/ui/deployments/chat/segments/code/remove", data={
        "csrf_token": token}).text
    assert "Segment code removed" in page
    assert 'data-segment="chat" class="in-use"' in page
    assert 'data-segment="code" class="removed"' in page
    viewer = sign_in_as("viewer").get("/ui/deployments/chat/segments").text
    assert "Declare" not in viewer and "Remove" not in viewer  # operators' forms only


@pytest.mark.slow
def test_an_anonymous_header_through_a_keyless_runtime_server_never_names_a_segment(
        live_server, tokens, engine):
    """A real runtime server without API keys, shipping to a real control plane: a stranger's
    X-Exitplane-Segment names reach neither the store nor the registry, whatever the
    deployment's opt-in; the operator's real segment is published."""
    from runtime.server import build_state
    from runtime.testing import ascii_tokenizer
    from tests.support.runtime_server import EXIT_LAYERS, serve, tiny_engine

    op = tokens.headers(tokens.operator)
    assert httpx.post(f"{live_server.url}/v1/deployments", headers=op, json={
        "name": "tiny", "model_ref": "tiny", "num_layers": 6, "exit_layers": EXIT_LAYERS,
        "signal": "maxprob"}).status_code == 201
    with Session(engine) as session:
        _, secret = create_token(session=session, name="rt", scope="runtime",
                                 deployment=get_deployment(session=session, name="tiny"))
        session.commit()
    state = build_state(engine=tiny_engine(), tokenizer=ascii_tokenizer(), model_name="t",
                        control_plane=live_server.url, deployment="tiny", token=secret,
                        state_dir=tempfile.mkdtemp())
    server = serve(state)
    served = next(server)
    try:
        assert state.thresholds.wait_ready(10)

        def squat(names: list[str]) -> None:
            for name in names:
                answer = httpx.post(f"{served.url}/v1/completions", timeout=30,
                                    headers={"X-Exitplane-Segment": name},
                                    json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
                assert answer.status_code == 200 and answer.json()["exitplane"]["segment"] == \
                    "default"
            assert state.shipper.flush(30)

        squat([*SQUATTERS, "late"])
        httpx.patch(f"{live_server.url}/v1/deployments/tiny", headers=op,
                    json={"auto_segments": True})
        squat([f"again{index}" for index in range(4)])
    finally:
        server.close()
    stored = _stored_by_segment(engine, "tiny")
    assert stored == {"default": 3 * (len(SQUATTERS) + 5)}
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="tiny")
        assert known_segments(session=session, deployment_id=deployment.id) == []
    published = httpx.post(f"{live_server.url}/v1/deployments/tiny/threshold-sets", headers=op,
                           json={"thresholds": dict.fromkeys(map(str, EXIT_LAYERS), 1.0),
                                 "segments": {"code": dict.fromkeys(map(str, EXIT_LAYERS), 0.9)},
                                 "reason": "the real segment"})
    assert published.status_code == 201, published.text
