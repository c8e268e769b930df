"""The threshold client with per-segment sets, against the real control plane over
HTTP: a runtime that applies segments pulls a segmented set, verifies it and looks thresholds up
by segment (default for an unknown or missing one); a runtime that applies one map to every
request refuses such a set, keeps its previous one and says why in its heartbeat; the torch
engine applies it per row; a set whose segment map does not fit the exit layers is refused."""

from __future__ import annotations

import httpx
import pytest

from exitplane.client.thresholds import (
    RefusedThresholdSet,
    ThresholdClient,
    check_threshold_set,
)
from exitplane.wire import ThresholdSetWire
from tests.support.runtime_link import DEPLOYMENT, EXIT_LAYERS, publish
from tests.support.waiting import patient_get, wait_until

FAST = {"long_poll_s": 0.2, "heartbeat_interval_s": 0.2, "backoff_initial_s": 0.05,
        "backoff_max_s": 0.5}
SEGMENTED = {"thresholds": {"2": 0.9, "4": 0.8}, "segments": {"code": {"2": 1.0, "4": 0.97}},
             "reason": "per segment", "activate": True}


class SegmentRuntime:
    """A runtime other than ours (the protocol's point) that applies a map per request."""

    applies_segments = True

    def __init__(self) -> None:
        self.exit_layers = list(EXIT_LAYERS)
        self.applied: list[ThresholdSetWire] = []
        self.runtime_id = "rt-seg"

    def set_thresholds(self, threshold_set: ThresholdSetWire) -> None:
        self.applied.append(threshold_set)


def _publish_segmented(operator: httpx.Client) -> dict:
    created = operator.post(f"/v1/deployments/{DEPLOYMENT}/threshold-sets", json=SEGMENTED)
    assert created.status_code == 201, created.text
    return created.json()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_segment_runtime_pulls_the_set_and_looks_up_by_segment(control_plane, operator,
                                                                 runtime_token):
    created = _publish_segmented(operator)
    target = SegmentRuntime()
    client = ThresholdClient(target, base_url=control_plane.url, deployment=DEPLOYMENT,
                             token=runtime_token, **FAST)
    assert client.thresholds_for("code") is None  # nothing applied yet
    client.start()
    try:
        assert client.wait_ready(20)
        assert client.applied.version == created["version"] == 2 and client.error is None
        assert target.applied[-1].checksum == created["checksum"]
        assert client.thresholds_for("code") == {2: 1.0, 4: 0.97}
        for other in ("chat", "default", None):
            assert client.thresholds_for(other) == {2: 0.9, 4: 0.8}
    finally:
        client.stop()


class OneMapRuntime(SegmentRuntime):
    """A runtime that applies one map to every request (no `applies_segments`)."""

    applies_segments = False


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_one_map_runtime_refuses_a_segmented_set_and_keeps_its_own(control_plane, operator,
                                                                      runtime_token):
    publish(operator, {2: 0.9, 4: 0.8})
    target = OneMapRuntime()
    target.runtime_id = "rt-one-map"
    client = ThresholdClient(target, base_url=control_plane.url, deployment=DEPLOYMENT,
                             token=runtime_token, **FAST).start()
    try:
        assert client.wait_ready(20) and client.applied.version == 2
        _publish_segmented(operator)
        wait_until(lambda: client.counters["refused"] >= 1, message="the segmented set refused")
        assert client.applied.version == 2 and target.applied[-1].version == 2
        assert "has thresholds per segment (code)" in client.error

        def reported() -> str:
            rows = patient_get(operator, f"/v1/deployments/{DEPLOYMENT}/runtimes").json()
            row = next((r for r in rows if r["runtime_id"] == "rt-one-map"), {})
            return row.get("error") or ""

        wait_until(lambda: "per segment" in reported(), message="the refusal in a heartbeat")
    finally:
        client.stop()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_torch_engine_applies_a_segmented_set_per_row(control_plane, operator,
                                                           runtime_token, make_engine):
    # default never exits, code leaves every token at the first exit layer
    created = operator.post(f"/v1/deployments/{DEPLOYMENT}/threshold-sets", json={
        "thresholds": {"2": 1.0, "4": 1.0}, "segments": {"code": {"2": 0.0, "4": 1.0}},
        "reason": "per segment", "activate": True})
    assert created.status_code == 201, created.text
    engine = make_engine(runtime_id="rt-torch")
    client = ThresholdClient(engine, base_url=control_plane.url, deployment=DEPLOYMENT,
                             token=runtime_token, **FAST).start()
    try:
        assert client.wait_ready(20) and client.error is None
        assert engine.policy.version == created.json()["version"]
        assert engine.policy.segments == {"code": {2: 0.0, 4: 1.0}}
        code = engine.add_request([1, 5, 9], max_new_tokens=3, stop_token_ids=[],
                                  segment="code")
        plain = engine.add_request([1, 5, 9], max_new_tokens=3, stop_token_ids=[])
        while engine.has_work:
            engine.step()
        exits: dict[str, set] = {code: set(), plain: set()}
        for record in engine.drain_records():
            exits[record.request_id].add((record.segment, record.exit_layer))
        assert exits == {code: {("code", 2)}, plain: {("default", 6)}}
    finally:
        client.stop()


@pytest.mark.parametrize("db_url", ["sqlite", "postgresql"], indirect=True)
def test_a_segment_travels_from_the_engine_row_to_the_store(control_plane, operator,
                                                            runtime_token, make_engine,
                                                            engine, tmp_path):
    """End to end: rows of one batch under a segmented set, their records through the real
    aggregating shipper (every token also sampled as a record), and the store's records and
    rollups per segment."""
    from sqlalchemy import text

    from tests.support.runtime_link import fast_shipper

    created = operator.post(f"/v1/deployments/{DEPLOYMENT}/threshold-sets", json={
        "thresholds": {"2": 1.0, "4": 1.0}, "segments": {"code": {"2": 0.0, "4": 1.0}},
        "reason": "per segment", "activate": True})
    assert created.status_code == 201, created.text
    version = created.json()["version"]
    runtime = make_engine(runtime_id="rt-e2e")
    client = ThresholdClient(runtime, base_url=control_plane.url, deployment=DEPLOYMENT,
                             token=runtime_token, **FAST).start()
    shipper = fast_shipper(control_plane.url, runtime_token, tmp_path / "spool", "rt-e2e",
                           raw_sample_rate=1.0, exit_layers=EXIT_LAYERS,
                           aggregate_interval_s=0.2).start()
    try:
        assert client.wait_ready(20) and runtime.policy.version == version
        for index in range(3):
            runtime.add_request([1, 5, 9 + index], max_new_tokens=4, stop_token_ids=[],
                                segment="code")
            runtime.add_request([2, 6, 9 + index], max_new_tokens=4, stop_token_ids=[])
        while runtime.has_work:
            runtime.step()
        records = runtime.drain_records()
        for record in records:
            assert shipper.submit(record)
        assert shipper.flush(60) and shipper.wait_replayed(60)
    finally:
        shipper.close(10)
        client.stop()
    with engine.connect() as connection:
        stored = dict(connection.execute(text(
            "SELECT segment, COUNT(*) FROM token_records WHERE runtime_id = 'rt-e2e' "
            "GROUP BY segment")).all())
        exits = {(segment, layer): count for segment, layer, count in connection.execute(text(
            "SELECT segment, layer, SUM(exits) FROM rollups WHERE runtime_id = 'rt-e2e' "
            "AND version = :v GROUP BY segment, layer"), {"v": version}).all() if count}
    assert stored == {"code": 12, "default": 12}
    assert exits == {("code", 2): 12, ("default", 6): 12}


def test_a_segment_map_that_misses_an_exit_layer_is_refused():
    wire = ThresholdSetWire.build(deployment=DEPLOYMENT, version=5, signal="maxprob",
                                  thresholds={2: 0.9, 4: 0.8}, segments={"code": {2: 0.99}})
    with pytest.raises(RefusedThresholdSet, match="segment 'code' has exit layers \\[2\\]"):
        check_threshold_set(wire, deployment=DEPLOYMENT, exit_layers=EXIT_LAYERS)
    fits = ThresholdSetWire.build(deployment=DEPLOYMENT, version=5, signal="maxprob",
                                  thresholds={2: 0.9, 4: 0.8},
                                  segments={"code": {2: 0.99, 4: 0.98}})
    check_threshold_set(fits, deployment=DEPLOYMENT, exit_layers=EXIT_LAYERS)
