"""The threshold client with per-segment sets (issue 18): it pulls a segmented set from the real
control plane, verifies it, looks thresholds up by segment (default for an unknown or missing
one), and refuses a set whose segment map does not fit its exit layers."""

from __future__ import annotations

import pytest

from exitplane.client.thresholds import (
    RefusedThresholdSet,
    ThresholdClient,
    check_threshold_set,
)
from exitplane.wire import ThresholdSetWire
from tests.runtime_link.conftest import DEPLOYMENT, EXIT_LAYERS


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_pulls_a_segmented_set_and_looks_up_by_segment(control_plane, operator, runtime_token,
                                                       make_engine):
    created = operator.post(f"/v1/deployments/{DEPLOYMENT}/threshold-sets", json={
        "thresholds": {"2": 0.9, "4": 0.8}, "segments": {"code": {"2": 1.0, "4": 0.97}},
        "reason": "per segment", "activate": True})
    assert created.status_code == 201, created.text
    engine = make_engine(runtime_id="rt-seg")
    client = ThresholdClient(engine, base_url=control_plane.url, deployment=DEPLOYMENT,
                             token=runtime_token, long_poll_s=0.2, heartbeat_interval_s=0.2,
                             backoff_initial_s=0.05, backoff_max_s=0.5)
    assert client.thresholds_for("code") is None  # nothing applied yet
    client.start()
    try:
        assert client.wait_ready(20)
        assert client.applied.version == 2 and client.error is None
        assert client.applied.checksum == created.json()["checksum"]
        assert client.thresholds_for("code") == {2: 1.0, 4: 0.97}
        for other in ("chat", "default", None):
            assert client.thresholds_for(other) == {2: 0.9, 4: 0.8}
    finally:
        client.stop()


def test_a_segment_map_that_misses_an_exit_layer_is_refused():
    wire = ThresholdSetWire.build(deployment=DEPLOYMENT, version=5, signal="maxprob",
                                  thresholds={2: 0.9, 4: 0.8}, segments={"code": {2: 0.99}})
    with pytest.raises(RefusedThresholdSet, match="segment 'code' has exit layers \\[2\\]"):
        check_threshold_set(wire, deployment=DEPLOYMENT, exit_layers=EXIT_LAYERS)
    fits = ThresholdSetWire.build(deployment=DEPLOYMENT, version=5, signal="maxprob",
                                  thresholds={2: 0.9, 4: 0.8},
                                  segments={"code": {2: 0.99, 4: 0.98}})
    check_threshold_set(fits, deployment=DEPLOYMENT, exit_layers=EXIT_LAYERS)
