"""The shadow rate the control plane sets reaches a running `Runtime` by long-poll and is what
`should_shadow()` applies; without one the runtime's own rate applies; the threshold cache
keeps the set alone; the runtime server's engine follows the rate and returns to its own."""

from __future__ import annotations

import json
from types import SimpleNamespace

from exitplane.client import Runtime
from exitplane.wire import ThresholdPull, ThresholdSetWire, pull_etag
from runtime.serving.state import shadow_rate_applier
from tests.support.runtime_link import DEPLOYMENT, EXIT_LAYERS, NUM_LAYERS, publish
from tests.support.waiting import wait_until

FAST = {"long_poll_s": 5.0, "heartbeat_interval_s": 5.0, "backoff_initial_s": 0.05,
        "backoff_max_s": 0.3}


def _bounds(operator, low: float, high: float) -> dict:
    answer = operator.patch(f"/v1/deployments/{DEPLOYMENT}",
                            json={"shadow_rate_min": low, "shadow_rate_max": high})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_the_runtime_applies_the_control_planes_rate_else_its_own(
        control_plane, operator, runtime_token, tmp_path):
    version = publish(operator, {2: 0.9, 4: 0.8})
    with Runtime(deployment=DEPLOYMENT, runtime_id="shadow-1", num_layers=NUM_LAYERS,
                 exit_layers=EXIT_LAYERS, url=control_plane.url, token=runtime_token,
                 state_dir=tmp_path / "state", shadow_rate=0.5,
                 threshold_options=FAST) as rt:
        assert rt.version == version
        assert (rt.shadow_rate, rt.shadow_rate_source) == (0.5, "local")  # none decided yet
        assert rt.metrics["thresholds_control_plane_shadow_rate"] == -1.0
        assert _bounds(operator, 0.0, 0.0)["shadow_rate"] == 0.0
        wait_until(lambda: rt.shadow_rate_source == "control_plane",
                   message="the fixed rate reaches the long-polling runtime")
        assert rt.shadow_rate == 0.0 and not any(rt.should_shadow() for _ in range(200))
        _bounds(operator, 1.0, 1.0)
        wait_until(lambda: rt.shadow_rate == 1.0, message="the new rate arrives")
        assert all(rt.should_shadow() for _ in range(200))
        assert rt.metrics["shadow_rate"] == 1.0
        assert rt.version == version  # the set did not change, only the rate
        rt.shadow_rate = 0.25  # the runtime's own: kept for when the control plane sets none
        assert (rt.shadow_rate, rt.local_shadow_rate) == (1.0, 0.25)
        _bounds(operator, 0.01, 0.2)  # the rate moves within the new bounds
        wait_until(lambda: rt.shadow_rate == 0.2, message="the rate moved within the bounds")
    cached = json.loads((tmp_path / "state" / "thresholds.json").read_text())
    assert "shadow_rate" not in cached  # the cache holds the set alone
    ThresholdSetWire.model_validate(cached).verify()


def test_the_pull_body_carries_the_rate_outside_the_checksum():
    wire = ThresholdSetWire.build(deployment=DEPLOYMENT, version=3, signal="maxprob",
                                  thresholds={2: 0.9, 4: 0.8})
    pulled = ThresholdPull(**wire.model_dump(), shadow_rate=0.05)
    pulled.verify()
    assert pulled.threshold_set() == wire
    assert json.loads(pulled.model_dump_json())["shadow_rate"] == 0.05
    assert "shadow_rate" not in json.loads(ThresholdPull(**wire.model_dump()).model_dump_json())
    assert pull_etag(wire.checksum, None) == wire.checksum
    assert pull_etag(wire.checksum, 0.05) == f"{wire.checksum}.s0.05"
    assert pull_etag(wire.checksum, 0.05) != pull_etag(wire.checksum, 0.06)


def test_the_runtime_servers_engine_follows_the_rate_and_returns_to_its_own():
    config = SimpleNamespace(shadow_rate=0.05)
    apply = shadow_rate_applier(config)
    apply(0.3)
    assert config.shadow_rate == 0.3
    apply(None)
    assert config.shadow_rate == 0.05
