"""One token may hold only so many long-polls on one API process (EXITPLANE_LONG_POLLS_PER_TOKEN):
each held poll is a socket and a file descriptor, and a leaked runtime token must not be able
to take them all. Past the cap a waiting pull is 429 + Retry-After, on the fast path (state
cached) and on the full route alike; other tokens and non-waiting pulls are not affected."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.support.deployments import issue_runtime_token, tuned_deployment
from tests.support.waiting import wait_until

CAP = 3


@pytest.fixture(params=[30.0, 0.0], ids=["fast-path", "route"])
def settings(settings, request):
    # A 30 s config cache: every poll finds the state cached (the pure-ASGI fast path);
    # 0: never cached, every poll goes through the FastAPI route.
    return settings.model_copy(update={"long_polls_per_token": CAP,
                                       "config_cache_ttl_s": request.param})


def test_a_token_holds_at_most_its_cap_of_long_polls(live_server, tokens, engine, app):
    with httpx.Client(base_url=live_server.url, timeout=30) as http:
        op, runtime, etag = tuned_deployment(http, tokens, engine)
        answers: list[httpx.Response] = []

        def poll(index: int, headers: dict) -> None:
            with httpx.Client(base_url=live_server.url, timeout=30) as own:
                answers.append(own.get("/v1/deployments/chat/thresholds",
                                       params={"runtime_id": f"rt-{index}", "wait": 20},
                                       headers={**headers, "If-None-Match": etag}))

        held = [threading.Thread(target=poll, args=(i, runtime)) for i in range(CAP)]
        for thread in held:
            thread.start()
        delivery = app.state.config_delivery
        wait_until(lambda: sum(delivery._held.values()) == CAP, message="the cap held")

        refused = http.get("/v1/deployments/chat/thresholds",
                           params={"runtime_id": "rt-extra", "wait": 20},
                           headers={**runtime, "If-None-Match": etag})
        assert refused.status_code == 429, refused.text
        assert "holds 3 long-polls" in refused.json()["detail"]
        assert 1 <= int(refused.headers["retry-after"]) <= 10
        # A pull that does not wait is still answered, and another token may hold its own.
        quick = http.get("/v1/deployments/chat/thresholds", params={"runtime_id": "rt-extra"},
                         headers={**runtime, "If-None-Match": etag})
        assert quick.status_code == 304
        _, other_runtime = issue_runtime_token(engine, name="rt-chat-other")
        other = threading.Thread(target=poll, args=(CAP, other_runtime))
        other.start()
        wait_until(lambda: sum(delivery._held.values()) == CAP + 1,
                   message="the other token's poll held")
        assert answers == []

        # A move answers every held poll and frees the token's places.
        moved = http.put("/v1/deployments/chat/aliases/active", headers=op,
                         json={"version": 2, "reason": "go"})
        assert moved.status_code == 200
        for thread in [*held, other]:
            thread.join(timeout=20)
        assert [answer.status_code for answer in answers] == [200] * (CAP + 1)
        assert delivery._held == {}
        etag = answers[0].headers["etag"]
        started = time.monotonic()
        again = http.get("/v1/deployments/chat/thresholds",
                         params={"runtime_id": "rt-extra", "wait": 0.3},
                         headers={**runtime, "If-None-Match": etag})
        assert again.status_code == 304 and time.monotonic() - started >= 0.25
