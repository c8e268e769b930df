"""Per-segment thresholds in the registry: one version holds every segment's map and
one checksum over all of them; names, layers and the per-deployment cap get a clear 422; the
pull carries the map, and a set without segments is pulled without a map."""

import re

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.deployments import service
from controlplane.deployments.models import AuditEvent
from controlplane.deployments.schemas import DeploymentCreate
from controlplane.errors import Invalid
from controlplane.settings import Settings
from exitplane.wire import ThresholdSetWire, threshold_checksum
from tests.support.deployments import mint_runtime_token, post_deployment

DEFAULT = {"3": 0.9, "6": 0.8, "9": 0.7}
SEGMENTS = {"code": {"3": 1.0, "6": 0.95, "9": 0.9}, "chat": {"3": 0.85, "6": 0.75, "9": 0.6}}


def _publish(client, op, **body):
    return client.post("/v1/deployments/chat/threshold-sets", headers=op,
                       json={"thresholds": DEFAULT, "reason": "per segment", **body})


def test_a_segmented_version_is_stored_read_and_pulled_as_one_checksummed_set(
        client, tokens, engine):
    op = post_deployment(client, tokens)
    created = _publish(client, op, segments=SEGMENTS, activate=True)
    assert created.status_code == 201, created.text
    read = created.json()
    assert read["version"] == 2
    assert read["segments"] == {"chat": {"3": 0.85, "6": 0.75, "9": 0.6},
                                "code": {"3": 1.0, "6": 0.95, "9": 0.9}}
    as_ints = {name: {int(k): v for k, v in m.items()} for name, m in SEGMENTS.items()}
    assert read["checksum"] == threshold_checksum(
        deployment="chat", version=2, signal="learned",
        thresholds={int(k): v for k, v in DEFAULT.items()}, segments=as_ints)
    shown = client.get("/v1/deployments/chat/threshold-sets/2", headers=op).json()
    assert shown["segments"] == read["segments"] and shown["checksum"] == read["checksum"]

    runtime = {"Authorization": f"Bearer {mint_runtime_token(engine, 'chat')}"}
    pulled = client.get("/v1/deployments/chat/thresholds", params={"runtime_id": "rt-1"},
                        headers=runtime)
    assert pulled.status_code == 200
    wire = ThresholdSetWire.model_validate_json(pulled.content)
    wire.verify()
    assert pulled.headers["etag"] == f'"{read["checksum"]}"' == f'"{wire.checksum}"'
    assert wire.for_segment("code") == {3: 1.0, 6: 0.95, 9: 0.9}
    assert wire.for_segment("retrieval") == {3: 0.9, 6: 0.8, 9: 0.7}

    with Session(engine) as session:
        event = session.scalars(select(AuditEvent).where(
            AuditEvent.action == "threshold_set.publish", AuditEvent.to_version == 2)).one()
        assert event.details["segments"] == ["chat", "code"]


def test_a_set_without_segments_is_pulled_and_checksummed_exactly_as_before(
        client, tokens, engine):
    op = post_deployment(client, tokens)
    created = _publish(client, op, activate=True)
    assert created.status_code == 201 and created.json()["segments"] is None
    # the checksum rule of protocol v1, written out: no segment key in the canonical JSON
    assert created.json()["checksum"] == threshold_checksum(
        deployment="chat", version=2, signal="learned", thresholds={3: 0.9, 6: 0.8, 9: 0.7})
    runtime = {"Authorization": f"Bearer {mint_runtime_token(engine, 'chat')}"}
    pulled = client.get("/v1/deployments/chat/thresholds", params={"runtime_id": "rt-1"},
                        headers=runtime)
    assert set(pulled.json()) == {"deployment", "version", "signal", "thresholds", "checksum"}
    empty = _publish(client, op, segments={})
    assert empty.status_code == 201 and empty.json()["segments"] is None


@pytest.mark.parametrize(("segments", "message"), [
    ({"Code": DEFAULT}, "segment name 'Code' is invalid"),
    ({"-code": DEFAULT}, "segment name '-code' is invalid"),
    ({"c" * 64: DEFAULT}, "is invalid"),
    ({"default": DEFAULT}, "segment 'default' is the set's own `thresholds`"),
    ({"code": {"3": 0.9, "6": 0.9}}, "segment 'code': missing thresholds for exit layers \\[9\\]"),
    ({"code": {**DEFAULT, "10": 0.5}}, "segment 'code': unknown exit layers \\[10\\]"),
    ({"code": {**DEFAULT, "9": 1.5}}, "segment 'code': threshold for layer 9 is 1.5"),
    ({"code": {**DEFAULT, "9": "x"}}, "segments.code.9"),
])
def test_invalid_segments_get_422_and_nothing_is_stored(client, tokens, segments, message):
    op = post_deployment(client, tokens)
    response = _publish(client, op, segments=segments)
    assert response.status_code == 422
    assert re.search(message, response.json()["detail"]), response.json()
    listed = client.get("/v1/deployments/chat/threshold-sets", headers=op).json()
    assert [s["version"] for s in listed] == [1]


def test_the_segment_cap_is_the_setting_and_overflow_gets_422(tokens, engine, db_url, tmp_path):
    from fastapi.testclient import TestClient

    from exitplane.app import create_app

    settings = Settings(database_url=db_url, var_dir=tmp_path / "var",
                        max_segments_per_deployment=2)
    app = create_app(settings, engine=engine)
    try:
        with TestClient(app) as client:
            op = post_deployment(client, tokens)
            two = {name: DEFAULT for name in ("chat", "code")}
            assert _publish(client, op, segments=two).status_code == 201
            three = {**two, "tools": DEFAULT}
            response = _publish(client, op, segments=three)
            assert response.status_code == 422
            assert response.json()["detail"] == (
                "3 segments given; a threshold set may name at most 2 besides 'default' "
                "(EXITPLANE_MAX_SEGMENTS_PER_DEPLOYMENT); send the rarer ones to the default "
                "thresholds")
    finally:
        app.state.config_delivery.close()


def test_the_service_defaults_to_the_settings_cap(session):
    deployment = service.create_deployment(
        session=session, actor="alice",
        spec=DeploymentCreate(name="chat", model_ref="m", num_layers=12, exit_layers=[3, 6]))
    maps = {f"s{i}": {3: 0.9, 6: 0.9} for i in range(Settings().max_segments_per_deployment)}
    published = service.publish(session=session, deployment=deployment, thresholds={3: 1, 6: 1},
                                segments=maps, reason="at the cap", actor="alice")
    assert len(published.segments_by_layer()) == Settings().max_segments_per_deployment == 16
    with pytest.raises(Invalid, match="at most 16 besides 'default'"):
        service.publish(session=session, deployment=deployment, thresholds={3: 1, 6: 1},
                        segments={**maps, "one-more": {3: 0.9, 6: 0.9}}, reason="over",
                        actor="alice")
    wire = service.to_wire(deployment=deployment, threshold_set=published)
    wire.verify()
    assert wire.segments == published.segments_by_layer()
