"""Long-polls held off the router: a fleet holds one per runtime at all times, so what each one
keeps alive while it waits is what the collector scans (the pull tail)."""

from __future__ import annotations

import gc
import threading
import time
import types

import httpx
import pytest

from tests.support.deployments import tuned_deployment

POLLS = 40


@pytest.fixture
def settings(settings):
    # The config cache lives long enough that every poll finds it warm (the bus drops it on a
    # move); with the tests' 0.2 s some polls would start on the full route.
    return settings.model_copy(update={"config_cache_ttl_s": 30.0})


def _answered(http: httpx.Client, status: int) -> float:
    """Pull answers with `status` that /metrics counts under the route's template."""
    prefix = ('exitplane_http_request_duration_seconds_count{method="GET",'
              f'route="/v1/deployments/{{name}}/thresholds",status="{status}"}}')
    return sum(float(line.rsplit(" ", 1)[1]) for line in http.get("/metrics").text.splitlines()
               if line.startswith(prefix))


def _coroutines() -> int:
    return sum(isinstance(o, types.CoroutineType) for o in gc.get_objects())


def test_held_long_polls_keep_few_objects_and_all_wake_on_a_move(live_server, tokens, engine):
    with httpx.Client(base_url=live_server.url, timeout=30) as http:
        op, runtime, etag = tuned_deployment(http, tokens, engine, runtime_id="rt-0")
        answers: dict[int, httpx.Response] = {}

        def poll(index: int) -> None:
            with httpx.Client(base_url=live_server.url, timeout=30) as own:
                answers[index] = own.get("/v1/deployments/chat/thresholds",
                                         params={"runtime_id": f"rt-{index}", "wait": 20},
                                         headers={**runtime, "If-None-Match": etag})

        answered = _answered(http, 200)
        before = _coroutines()
        pollers = [threading.Thread(target=poll, args=(i,)) for i in range(POLLS)]
        for poller in pollers:
            poller.start()
        time.sleep(1.5)
        assert not answers  # all still waiting
        held = (_coroutines() - before) / POLLS
        # Through FastAPI's router a held poll kept 28 coroutines alive, here 12 (the
        # process's other coroutines come and go meanwhile: 14.1 once on a loaded machine).
        assert held <= 16, f"{held:.1f} coroutines per held long-poll"

        moved = http.put("/v1/deployments/chat/aliases/active", headers=op,
                         json={"version": 2, "reason": "go"})
        assert moved.status_code == 200
        for poller in pollers:
            poller.join(timeout=20)
        assert len(answers) == POLLS
        assert {r.status_code for r in answers.values()} == {200}
        assert {r.json()["version"] for r in answers.values()} == {2}
        first = answers[0]
        assert first.headers["etag"] == f'"{first.json()["checksum"]}"'
        assert first.headers["x-exitplane-version"] == "2"
        assert first.headers["content-type"] == "application/json"

        # Metrics and logs name the route, not 'unmatched'.
        assert _answered(http, 200) - answered == POLLS


def test_a_long_poll_that_ends_unchanged_is_304_and_bad_waits_get_the_routes_422(
        live_server, tokens, engine):
    with httpx.Client(base_url=live_server.url, timeout=30) as http:
        _, runtime, etag = tuned_deployment(http, tokens, engine)  # v2 published, not active
        started = time.monotonic()
        unchanged = http.get("/v1/deployments/chat/thresholds",
                             params={"runtime_id": "r", "wait": 0.5},
                             headers={**runtime, "If-None-Match": etag})
        assert unchanged.status_code == 304 and unchanged.headers["etag"] == etag
        assert time.monotonic() - started >= 0.45  # it waited
        for wait in ("301", "-1", "soon", "nan"):
            refused = http.get("/v1/deployments/chat/thresholds",
                               params={"runtime_id": "r", "wait": wait},
                               headers={**runtime, "If-None-Match": etag})
            assert refused.status_code == 422, (wait, refused.text)
        bad_id = http.get("/v1/deployments/chat/thresholds",
                          params={"runtime_id": "no spaces", "wait": 1},
                          headers={**runtime, "If-None-Match": etag})
        assert bad_id.status_code == 422
