"""The shadow-request rate the control plane sets reaches a running `Runtime` in its pulls and
is what `draw_shadow_request()` applies (seeded: the same choices again); without one the
runtime's own rate applies; the pull's ETag carries the rate only for runtimes that apply the
rates; a shadow request's tokens, recorded through the facade, are taken by the control plane;
the runtime server's engine follows the rate and returns to its own."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import httpx

from exitplane.client import Runtime
from exitplane.wire import ThresholdPull, pull_etag
from runtime.serving.state import shadow_rate_applier
from tests.support.runtime_link import DEPLOYMENT, EXIT_LAYERS, NUM_LAYERS, publish
from tests.support.waiting import wait_until

FAST = {"long_poll_s": 1.0, "heartbeat_interval_s": 1.0, "backoff_initial_s": 0.05,
        "backoff_max_s": 0.3}


def _rate(operator, rate: float | None) -> None:
    answer = operator.patch(f"/v1/deployments/{DEPLOYMENT}",
                            json={"shadow_request_rate": rate})
    assert answer.status_code == 200, answer.text
    assert answer.json()["shadow_request_rate"] == rate


def test_the_runtime_draws_at_the_control_planes_rate_else_its_own(
        control_plane, operator, runtime_token, tmp_path):
    version = publish(operator, {2: 0.9, 4: 0.8})
    with Runtime(deployment=DEPLOYMENT, runtime_id="shadow-req-1", num_layers=NUM_LAYERS,
                 exit_layers=EXIT_LAYERS, url=control_plane.url, token=runtime_token,
                 state_dir=tmp_path / "state", shadow_request_rate=0.5,
                 shadow_request_rng=random.Random(3), threshold_options=FAST) as rt:
        assert rt.version == version
        assert (rt.shadow_request_rate, rt.shadow_request_rate_source) == (0.5, "local")
        assert rt.metrics["thresholds_control_plane_shadow_request_rate"] == -1.0
        expected = random.Random(3)
        drawn = [rt.draw_shadow_request() for _ in range(50)]
        assert drawn == [expected.random() < 0.5 for _ in range(50)]  # the injected stream
        assert rt.metrics["shadow_requests"] == sum(drawn) > 0

        _rate(operator, 1.0)
        wait_until(lambda: rt.shadow_request_rate_source == "control_plane", timeout=30,
                   message="the control plane's rate reaches the runtime")
        assert rt.shadow_request_rate == 1.0
        assert all(rt.draw_shadow_request() for _ in range(20))
        assert rt.metrics["shadow_request_rate"] == 1.0
        assert rt.metrics["thresholds_control_plane_shadow_request_rate"] == 1.0
        rt.shadow_request_rate = 0.25  # the runtime's own, kept for when none is set
        assert (rt.shadow_request_rate, rt.local_shadow_request_rate) == (1.0, 0.25)

        _rate(operator, 0.0)
        wait_until(lambda: rt.shadow_request_rate == 0.0, timeout=30,
                   message="a rate of 0 arrives")
        assert not any(rt.draw_shadow_request() for _ in range(50))

        _rate(operator, None)
        wait_until(lambda: rt.shadow_request_rate_source == "local", timeout=30,
                   message="the control plane sets none again")
        assert rt.shadow_request_rate == 0.25
        assert rt.version == version  # only the rate moved, never the set

        points = rt.shadow({2: 0.4, 4: 0.7}, {2: False, 4: True})
        for position in range(3):
            assert rt.record(request_id="answer-1", position=position,
                             exit_layer=NUM_LAYERS, signal_value=0.7, shadow=points,
                             shadow_request=True, request_end=position == 2)
        assert rt.flush(20)
        assert rt.metrics["telemetry_rejected_batches"] == 0
        assert rt.metrics["telemetry_sent_records"] >= 3
    cached = json.loads((tmp_path / "state" / "thresholds.json").read_text())
    assert "shadow_request_rate" not in cached  # the cache holds the set alone


def test_the_pull_etag_carries_the_rate_for_runtimes_that_apply_it(
        control_plane, operator, runtime_token):
    publish(operator, {2: 0.9, 4: 0.8})
    _rate(operator, 0.125)
    with httpx.Client(base_url=control_plane.url, timeout=30,
                      headers={"Authorization": f"Bearer {runtime_token}"}) as http:
        def pull(rate: bool, requests: bool, etag: str | None = None) -> httpx.Response:
            answer = http.get(f"/v1/deployments/{DEPLOYMENT}/thresholds",
                              params={"runtime_id": "etag-1",
                                      "applies_shadow_rate": str(rate).lower(),
                                      "applies_shadow_requests": str(requests).lower()},
                              headers={"If-None-Match": etag} if etag else {})
            assert answer.status_code in (200, 304), answer.text
            return answer

        def settled() -> bool:  # the delivery cache re-reads the deployment within its ttl
            return ThresholdPull.model_validate_json(pull(True, True).content
                                                     ).shadow_request_rate == 0.125

        wait_until(settled, timeout=30, message="the rate is in the pull body")
        applying, rate_only, other = pull(True, True), pull(True, False), pull(False, False)
        body = ThresholdPull.model_validate_json(applying.content)
        assert applying.headers["etag"] == \
            f'"{pull_etag(body.checksum, body.shadow_rate, 0.125)}"'
        assert applying.headers["etag"].endswith('.r0.125"')
        # A runtime that knows the shadow rate only keeps the tag it computes itself.
        assert rate_only.headers["etag"] == f'"{pull_etag(body.checksum, body.shadow_rate)}"'
        assert other.headers["etag"] == f'"{body.checksum}"'  # the set's checksum alone
        body.threshold_set().verify()
        assert pull(True, True, applying.headers["etag"]).status_code == 304
        assert pull(True, False, rate_only.headers["etag"]).status_code == 304


def test_the_runtime_servers_engine_follows_the_shadow_request_rate():
    config = SimpleNamespace(shadow_rate=0.05, shadow_request_rate=0.01)
    apply = shadow_rate_applier(config, "shadow_request_rate")
    apply(0.5)
    assert (config.shadow_request_rate, config.shadow_rate) == (0.5, 0.05)
    apply(None)
    assert config.shadow_request_rate == 0.01


def test_an_aggregating_runtime_ships_every_shadow_request_token_as_a_record(
        control_plane, operator, runtime_token, tmp_path):
    publish(operator, {2: 0.9, 4: 0.8})
    with Runtime(deployment=DEPLOYMENT, runtime_id="shadow-req-agg", num_layers=NUM_LAYERS,
                 exit_layers=EXIT_LAYERS, url=control_plane.url, token=runtime_token,
                 state_dir=tmp_path / "state", raw_sample_rate=0.0,
                 threshold_options=FAST) as rt:
        points = rt.shadow({2: 0.4, 4: 0.7}, {2: True, 4: False})
        for position in range(4):
            rt.record(request_id="answer-2", position=position, exit_layer=NUM_LAYERS,
                      signal_value=0.7, shadow=points, shadow_request=True,
                      request_end=position == 3)
        for position in range(10):  # ordinary tokens: counted, none shipped at rate 0
            rt.record(request_id="plain-1", position=position, exit_layer=2,
                      signal_value=0.95)
        assert rt.flush(20)
        assert rt.metrics["telemetry_rejected_batches"] == 0
        assert rt.metrics["telemetry_sent_records"] == 4  # the shadow request's tokens only
        assert rt.metrics["telemetry_sent_aggregate_tokens"] == 14  # every token counted
