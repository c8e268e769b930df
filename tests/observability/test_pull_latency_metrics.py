"""A threshold pull held as a long-poll is measured in two parts: its wait in
exitplane_config_long_poll_wait_seconds, the rest in the pull route's
exitplane_http_request_duration_seconds, so the route's latency is not the `wait` runtimes ask
(the fast path, and the full route a token not yet cached takes)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support.deployments import mint_runtime_token, tuned_deployment

ROUTE = "/v1/deployments/{name}/thresholds"
WAIT_S = 1.5


def _figures(http: httpx.Client) -> dict[str, float]:
    """Count and sum of the wait histogram and of the pull route's 304 durations."""
    figures = dict.fromkeys(("wait_count", "wait_sum", "pull_count", "pull_sum"), 0.0)
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if family.name == "exitplane_config_long_poll_wait_seconds":
                kind = "wait"
            elif (family.name == "exitplane_http_request_duration_seconds"
                  and sample.labels.get("route") == ROUTE and sample.labels["status"] == "304"):
                kind = "pull"
            else:
                continue
            for suffix in ("count", "sum"):
                if sample.name.endswith(f"_{suffix}"):
                    figures[f"{kind}_{suffix}"] += sample.value
    return figures


def test_long_poll_waits_have_their_own_histogram(live_server, tokens, engine):
    with httpx.Client(base_url=live_server.url, timeout=30) as http:
        _, warm, etag = tuned_deployment(http, tokens, engine, runtime_id="rt-warm")
        cold = {"Authorization": f"Bearer {mint_runtime_token(engine, 'chat')}"}
        for headers in (warm, cold):  # the fast path, then the full route
            before = _figures(http)
            answer = http.get("/v1/deployments/chat/thresholds",
                              params={"runtime_id": "rt-1", "wait": WAIT_S},
                              headers={**headers, "If-None-Match": etag})
            assert answer.status_code == 304
            after = _figures(http)
            assert after["wait_count"] - before["wait_count"] == 1
            assert after["wait_sum"] - before["wait_sum"] >= WAIT_S - 0.05
            assert after["pull_count"] - before["pull_count"] == 1
            assert after["pull_sum"] - before["pull_sum"] < WAIT_S / 3

        # A pull that does not wait records no wait.
        before = _figures(http)
        assert http.get("/v1/deployments/chat/thresholds", params={"runtime_id": "rt-1"},
                        headers={**warm, "If-None-Match": etag}).status_code == 304
        assert _figures(http)["wait_count"] == before["wait_count"]
