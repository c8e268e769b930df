"""The edge's fast paths answer exactly as the routes they stand in for: the same requests sent
to an app with its fast paths and to one without them (the pull's taken out of the front door,
the telemetry one turned off by EXITPLANE_TELEMETRY_FAST_PATH=false) get the same status, the
same headers that matter (ETag, Cache-Control, X-Exitplane-Version, WWW-Authenticate,
Retry-After, Content-Type) and the same body: good, bad, missing and foreign bearer tokens,
If-None-Match forms, long-poll waits in and out of range, telemetry batches and heartbeats."""

from __future__ import annotations

import random
import threading
import time

import msgpack
import pytest
from fastapi.testclient import TestClient

from controlplane.edge.front import RequestContext
from controlplane.edge.pull_fast_path import NotModifiedFastPath
from exitplane.app import create_app
from tests.support.batches import random_batch
from tests.support.deployments import deploy_for_telemetry
from tests.support.network import RouterSpy
from tests.support.waiting import wait_until

PULL = "/v1/deployments/chat/thresholds"
HEARTBEATS = "/v1/deployments/chat/heartbeats"
COMPARED = ("etag", "cache-control", "x-exitplane-version", "www-authenticate", "retry-after",
            "content-type")




def _without_pull_fast_path(layer):
    """`layer` (a front door) with every NotModifiedFastPath in it taken out."""
    while isinstance(layer, NotModifiedFastPath):
        layer = layer.app
    if isinstance(layer, RequestContext):
        layer.app = _without_pull_fast_path(layer.app)
    return layer


@pytest.fixture
def pair(settings, engine):
    """start(**settings) -> {True: (app, client) with the fast paths, False: without them},
    both on one store."""
    made = []

    def start(**update):
        apps = {}
        for fast in (True, False):
            app = create_app(settings.model_copy(update={
                "config_cache_ttl_s": 30.0, **update, "telemetry_fast_path": fast}),
                engine=engine)
            if not fast:
                app.front = _without_pull_fast_path(app.front)
                assert not isinstance(app.front, NotModifiedFastPath)
            app.router = RouterSpy(app.router)  # before the first request builds the stack
            client = TestClient(app).__enter__()
            made.append((app, client))
            apps[fast] = (app, client)
        return apps

    yield start
    for app, client in made:
        client.__exit__(None, None, None)
        app.state.config_delivery.close()
        app.state.heartbeats.close()


def _shape(response, drop=()) -> tuple:
    """Status, the compared headers and the body (JSON without the fields in `drop`)."""
    headers = {name: response.headers.get(name) for name in COMPARED}
    if not response.content:
        return response.status_code, headers, b""
    body = response.json()
    if isinstance(body, dict):
        body = {key: value for key, value in body.items() if key not in drop}
    return response.status_code, headers, body


def _chat(client, tokens, engine) -> tuple[dict, dict, dict]:
    """'chat' (its set active) and 'code'; the operator's, chat's and code's runtime headers."""
    chat = deploy_for_telemetry(client, tokens, engine)
    code = deploy_for_telemetry(client, tokens, engine, name="code")
    return tokens.headers(tokens.operator), chat, code


def test_pulls_are_answered_alike_with_and_without_the_fast_path(pair, tokens, engine):
    apps = pair(rate_limit_pull_per_s=0)  # no refusals: each request is answered on its own
    fast_app, fast = apps[True]
    _, plain = apps[False]
    operator, runtime, foreign = _chat(fast, tokens, engine)
    secret = runtime["Authorization"].removeprefix("Bearer ")
    for client in (fast, plain):  # fills each process's token and config caches
        first = client.get(PULL, params={"runtime_id": "r-1"}, headers=runtime)
        assert first.status_code == 200
    etag = first.headers["etag"]
    tag = etag.strip('"')

    cases = [
        # bearer tokens
        (runtime, etag, {}),
        ({"Authorization": f"bearer {secret}"}, etag, {}),
        ({"Authorization": f"Bearer   {secret}  "}, etag, {}),
        (operator, etag, {}),  # operators reach every deployment
        (foreign, etag, {}),  # another deployment's runtime token: 403
        ({}, etag, {}),
        ({"Authorization": "Bearer ept_unknown"}, etag, {}),
        ({"Authorization": "Bearer "}, etag, {}),
        ({"Authorization": f"Basic {secret}"}, etag, {}),
        # If-None-Match: one tag, weak, a list, *, another set's, none
        (runtime, f"W/{etag}", {}),
        (runtime, f'"0000", {etag}', {}),
        (runtime, f'W/"0000" , W/{etag}', {}),
        (runtime, "*", {}),
        (runtime, tag, {}),  # unquoted
        (runtime, '"0000"', {}),
        (runtime, None, {}),
        (runtime, "", {}),
        # long-poll waits (the set does not change: 304 when the wait ends) and bad ones
        (runtime, etag, {"wait": "0.05"}),
        (runtime, etag, {"wait": "5e-2"}),
        (runtime, "*", {"wait": "0.05"}),
        (runtime, etag, {"wait": "0"}),
        (runtime, etag, {"wait": "-1"}),
        (runtime, etag, {"wait": "300.5"}),
        (runtime, etag, {"wait": "soon"}),
        (runtime, etag, {"wait": "nan"}),
        (runtime, etag, {"wait": "inf"}),
        (runtime, '"0000"', {"wait": "0.05"}),  # a stale tag is answered at once
        # runtime ids
        (runtime, etag, {"runtime_id": "bad id"}),
        (runtime, etag, {"runtime_id": None}),
    ]
    answers = {}
    for label, client in (("fast", fast), ("plain", plain)):
        answers[label] = []
        for headers, if_none_match, query in cases:
            params = {"runtime_id": "r-1", **query}
            params = {key: value for key, value in params.items() if value is not None}
            sent = dict(headers)
            if if_none_match is not None:
                sent["If-None-Match"] = if_none_match
            answers[label].append(_shape(client.get(PULL, params=params, headers=sent)))
    for case, fast_answer, plain_answer in zip(cases, answers["fast"], answers["plain"],
                                               strict=True):
        assert fast_answer == plain_answer, case
    statuses = [answer[0] for answer in answers["fast"]]
    assert statuses[:9] == [304, 304, 304, 304, 403, 401, 401, 401, 401]
    assert statuses[9:17] == [304, 304, 304, 304, 304, 200, 200, 200]
    assert statuses[17:] == [304, 304, 304, 304, 422, 422, 422, 422, 422, 200, 422, 422]
    assert answers["fast"][5][1]["www-authenticate"] == "Bearer"
    # The fast path answered the plain 304s itself, without the router.
    spy = fast_app.router
    spy.paths.clear()
    assert fast.get(PULL, params={"runtime_id": "r-1"},
                    headers={**runtime, "If-None-Match": f'"0000", W/{etag}'}).status_code == 304
    assert fast.get(PULL, params={"runtime_id": "r-1"},
                    headers={**runtime, "If-None-Match": "*"}).status_code == 304
    assert spy.paths == []


def test_a_long_poll_on_any_set_ends_alike_when_the_set_moves(pair, tokens, engine):
    """`If-None-Match: *` holds a long-poll until the set moves, then answers 304 with the new
    set's ETag: the fast path holds it as the route does."""
    apps = pair(rate_limit_pull_per_s=0)
    _, fast = apps[True]
    _, plain = apps[False]
    operator, runtime, _ = _chat(fast, tokens, engine)
    answers, routed = {}, {}
    for label, client, version in (("fast", fast, 1), ("plain", plain, 2)):
        client.get(PULL, params={"runtime_id": "r-1"}, headers=runtime)  # fills the caches
        client.app.router.paths.clear()
        held: list = []
        poll = threading.Thread(target=lambda client=client, held=held: held.append(client.get(
            PULL, params={"runtime_id": "r-1", "wait": "3"},
            headers={**runtime, "If-None-Match": "*"})))
        poll.start()
        time.sleep(0.5)  # the poll is held (were it not yet, it would wait out its 3 s)
        assert client.put("/v1/deployments/chat/aliases/active", headers=operator, json={
            "version": version, "reason": "move"}).status_code == 200
        poll.join(timeout=10)
        routed[label] = list(client.app.router.paths)
        moved = client.get(PULL, params={"runtime_id": "r-1"}, headers=runtime)
        status, headers, body = _shape(held[0])
        assert headers.pop("etag") == moved.headers["etag"]
        assert headers.pop("x-exitplane-version") == str(version)
        answers[label] = (status, headers, body)
    assert answers["fast"] == answers["plain"]
    assert answers["fast"][0] == 304
    assert PULL not in routed["fast"] and PULL in routed["plain"]  # the fast path held it


def test_a_change_of_shadow_rate_alone_is_delivered_alike(pair, tokens, engine):
    """A runtime that applies the control plane's shadow rate gets an ETag that changes with
    the rate: a new rate alone answers its current tag with 200 (the rate in the body), its
    new tag gets 304, a runtime that does not apply it keeps the set's checksum as its tag;
    a long-poll ends when the rate changes. The fast path answers as the route does."""
    apps = pair(rate_limit_pull_per_s=0)
    fast_app, fast = apps[True]
    _, plain = apps[False]
    operator, runtime, _ = _chat(fast, tokens, engine)
    applies = {"runtime_id": "r-1", "applies_shadow_rate": "true"}
    answers = {}
    for label, client, rate, next_rate in (("fast", fast, 0.25, 0.5), ("plain", plain, 0.3, 0.6)):
        first = client.get(PULL, params=applies, headers=runtime)
        checksum = first.json()["checksum"]
        before = first.json().get("shadow_rate")  # none yet; then the bounds' maximum
        assert first.headers["etag"] == (f'"{checksum}"' if before is None
                                         else f'"{checksum}.s{before:g}"')
        fixed = client.patch("/v1/deployments/chat", headers=operator, json={
            "shadow_rate_min": rate, "shadow_rate_max": rate})
        assert fixed.status_code == 200, fixed.text
        assert fixed.json()["shadow_rate"] == rate
        stale = client.get(PULL, params=applies,
                           headers={**runtime, "If-None-Match": first.headers["etag"]})
        tagged = client.get(PULL, params=applies,
                            headers={**runtime, "If-None-Match": stale.headers["etag"]})
        untagged = client.get(PULL, params={"runtime_id": "r-1"},  # applies no rate
                              headers={**runtime, "If-None-Match": f'"{checksum}"'})
        bad = client.get(PULL, params={**applies, "applies_shadow_rate": "maybe"},
                         headers={**runtime, "If-None-Match": stale.headers["etag"]})
        held: list = []
        poll = threading.Thread(target=lambda client=client, held=held, tag=stale.headers[
            "etag"]: held.append(client.get(PULL, params={**applies, "wait": "5"},
                                            headers={**runtime, "If-None-Match": tag})))
        poll.start()
        time.sleep(0.5)  # the poll is held (were it not yet, it would wait out its 5 s)
        assert client.patch("/v1/deployments/chat", headers=operator, json={
            "shadow_rate_min": next_rate, "shadow_rate_max": next_rate}).status_code == 200
        poll.join(timeout=10)
        assert stale.status_code == 200 and stale.json()["shadow_rate"] == rate
        assert stale.json()["checksum"] == checksum
        assert stale.headers["etag"] == f'"{checksum}.s{rate:g}"'
        assert (tagged.status_code, untagged.status_code, bad.status_code) == (304, 304, 422)
        assert untagged.headers["etag"] == f'"{checksum}"'
        assert held[0].status_code == 200 and held[0].json()["shadow_rate"] == next_rate
        assert held[0].headers["etag"] == f'"{checksum}.s{next_rate:g}"'
        answers[label] = [_shape(answer, drop=("shadow_rate",)) for answer in
                          (stale, tagged, untagged, bad)]
        for shape in answers[label]:
            shape[1].pop("etag")
        client.patch("/v1/deployments/chat", headers=operator, json={
            "shadow_rate_min": 0.01, "shadow_rate_max": 0.2})  # the rate moves within: 0.2
    assert answers["fast"] == answers["plain"]
    # The fast path answered a current rate-tagged ETag itself, without the router.
    current = fast.get(PULL, params=applies, headers=runtime).headers["etag"]
    assert current.endswith('.s0.2"')
    fast_app.router.paths.clear()
    assert fast.get(PULL, params=applies,
                    headers={**runtime, "If-None-Match": current}).status_code == 304
    assert fast_app.router.paths == []


def test_a_shadow_request_rate_is_tagged_only_for_runtimes_that_serve_it(pair, tokens,
                                                                          engine):
    """With a shadow-request rate set, a runtime that says it serves shadow requests gets
    `.r<rate>` in its ETag; one that applies the shadow rate alone keeps the tag it computes
    (304 on it), and one that applies neither keeps the checksum. The fast path answers as the
    route does."""
    apps = pair(rate_limit_pull_per_s=0)
    _, fast = apps[True]
    _, plain = apps[False]
    operator, runtime, _ = _chat(fast, tokens, engine)
    fixed = fast.patch("/v1/deployments/chat", headers=operator, json={
        "shadow_rate_min": 0.25, "shadow_rate_max": 0.25, "shadow_request_rate": 0.125})
    assert fixed.status_code == 200, fixed.text
    both = {"runtime_id": "r-1", "applies_shadow_rate": "true",
            "applies_shadow_requests": "true"}
    rate_only = {"runtime_id": "r-1", "applies_shadow_rate": "true"}
    answers = {}
    for label, client in (("fast", fast), ("plain", plain)):
        def settled(client=client) -> bool:  # each app's delivery cache re-reads in its ttl
            return client.get(PULL, params=both, headers=runtime).json().get(
                "shadow_request_rate") == 0.125
        wait_until(settled, timeout=30, message="the shadow-request rate reaches the pull")
        first = client.get(PULL, params=both, headers=runtime)
        checksum = first.json()["checksum"]
        assert first.headers["etag"] == f'"{checksum}.s0.25.r0.125"'
        replies = [client.get(PULL, params=params, headers={**runtime, "If-None-Match": tag})
                   for params, tag in ((both, first.headers["etag"]),
                                       (rate_only, f'"{checksum}.s0.25"'),
                                       ({"runtime_id": "r-1"}, f'"{checksum}"'),
                                       (rate_only, first.headers["etag"]))]
        assert [reply.status_code for reply in replies] == [304, 304, 304, 200]
        assert replies[3].headers["etag"] == f'"{checksum}.s0.25"'
        answers[label] = [_shape(reply) for reply in replies]
    assert answers["fast"] == answers["plain"]
    # A change of the rate alone ends a held long-poll at once (the deployment's notice).
    tag = fast.get(PULL, params=both, headers=runtime).headers["etag"]
    held: list = []
    poll = threading.Thread(target=lambda: held.append(fast.get(
        PULL, params={**both, "wait": "20"}, headers={**runtime, "If-None-Match": tag})))
    started = time.monotonic()
    poll.start()
    time.sleep(0.5)
    assert fast.patch("/v1/deployments/chat", headers=operator, json={
        "shadow_request_rate": 0.5}).status_code == 200
    poll.join(timeout=30)
    assert time.monotonic() - started < 10
    assert held[0].status_code == 200 and held[0].json()["shadow_request_rate"] == 0.5
    assert held[0].headers["etag"].endswith('.r0.5"')


def test_pull_refusals_past_the_rate_are_answered_alike(pair, tokens, engine):
    # One pull per 20 s: the first takes the bucket's unit, the next waits about 20 s.
    apps = pair(rate_limit_pull_per_s=0.05)
    _, fast = apps[True]
    _, plain = apps[False]
    _, runtime, _ = _chat(fast, tokens, engine)
    answers = {}
    for label, client in (("fast", fast), ("plain", plain)):
        etag = client.get(PULL, params={"runtime_id": "r-1"}, headers=runtime).headers["etag"]
        status, headers, body = _shape(client.get(PULL, params={"runtime_id": "r-1"}, headers={
            **runtime, "If-None-Match": etag}))
        # The wait counts down between the two apps' requests: compared to the second.
        wait = int(headers.pop("retry-after"))
        assert 18 <= wait <= 20
        body["detail"] = body["detail"].split(";")[0]
        answers[label] = (status, headers, body)
    assert answers["fast"] == answers["plain"]
    assert answers["fast"][0] == 429


def test_telemetry_and_heartbeats_are_answered_alike_with_and_without_the_fast_path(
        pair, tokens, engine):
    apps = pair()
    fast_app, fast = apps[True]
    _, plain = apps[False]
    operator, runtime, foreign = _chat(fast, tokens, engine)
    secret = runtime["Authorization"].removeprefix("Bearer ")
    rng = random.Random(43)

    def telemetry_cases():
        """(headers, body kwargs) per request; fresh batches each call."""
        bad = random_batch(rng, n=5)
        bad["records"][2]["exit_layer"] = 7
        json_type = {"Content-Type": "application/json"}
        msgpack_type = {"Content-Type": "application/msgpack"}
        return [
            ({**runtime, **json_type}, {"json": random_batch(rng, n=5)}),
            ({**runtime, **msgpack_type},
             {"content": msgpack.packb(random_batch(rng, n=5))}),
            ({**operator, **json_type}, {"json": random_batch(rng, n=3)}),
            ({"Authorization": f"bearer {secret}", **json_type},
             {"json": random_batch(rng, n=3)}),
            ({**runtime, **json_type}, {"json": bad}),
            ({**runtime, **msgpack_type}, {"content": msgpack.packb(bad)}),
            ({**runtime, **msgpack_type}, {"content": b"\xc1\x00"}),
            ({**runtime, **json_type}, {"content": b"{not json"}),
            ({**runtime, "Content-Type": "application/vnd.exitplane.future+json"},
             {"content": b"{}"}),
            ({**foreign, **json_type}, {"json": random_batch(rng, n=3)}),
            (json_type, {"json": random_batch(rng, n=3)}),
            ({"Authorization": "Bearer ept_unknown", **json_type},
             {"json": random_batch(rng, n=3)}),
            ({"Authorization": "Bearer ", **json_type}, {"json": random_batch(rng, n=3)}),
            ({"Authorization": f"Basic {secret}", **json_type},
             {"json": random_batch(rng, n=3)}),
        ]

    heartbeat_cases = [
        (runtime, HEARTBEATS, {"json": {"runtime_id": "rt-beat"}}),
        (runtime, HEARTBEATS, {"json": {"runtime_id": "rt-beat", "applied_version": 2}}),
        (runtime, HEARTBEATS, {"json": {"runtime_id": "rt-beat"}}),  # held for the bulk write
        (runtime, HEARTBEATS, {"json": {"runtime_id": "bad id"}}),
        (runtime, HEARTBEATS, {"json": ["not", "a", "beat"]}),
        (runtime, HEARTBEATS, {"content": b"{not json",
                               "headers": {"Content-Type": "application/json"}}),
        (runtime, HEARTBEATS, {"content": b"runtime_id=rt-beat",
                               "headers": {"Content-Type": "text/plain"}}),
        (foreign, HEARTBEATS, {"json": {"runtime_id": "rt-beat"}}),
        (runtime, "/v1/deployments/absent/heartbeats", {"json": {"runtime_id": "rt-beat"}}),
        (operator, "/v1/deployments/absent/heartbeats", {"json": {"runtime_id": "rt-beat"}}),
        ({}, HEARTBEATS, {"json": {"runtime_id": "rt-beat"}}),
        ({"Authorization": "Bearer ept_unknown"}, HEARTBEATS,
         {"json": {"runtime_id": "rt-beat"}}),
    ]
    # Each app gets batches of its own (one store: no false replay); time fields differ.
    drop = ("batch_id", "first_seen", "last_seen")
    answers = {}
    for label, client in (("fast", fast), ("plain", plain)):
        answers[label] = []
        for headers, kwargs in telemetry_cases():
            answers[label].append(_shape(client.post("/v1/telemetry", headers=headers,
                                                     **kwargs), drop))
        for headers, path, kwargs in heartbeat_cases:
            kwargs = dict(kwargs)
            sent = {**headers, **kwargs.pop("headers", {})}
            answers[label].append(_shape(client.post(path, headers=sent, **kwargs), drop))
    for fast_answer, plain_answer in zip(answers["fast"], answers["plain"], strict=True):
        assert fast_answer == plain_answer
    statuses = [answer[0] for answer in answers["fast"]]
    assert statuses[:14] == [202, 202, 202, 202, 422, 422, 422, 422, 415, 403, 401, 401, 401,
                             401]
    assert statuses[14:] == [200, 200, 200, 422, 422, 422, 415, 403, 403, 404, 401, 401]
    assert "/v1/telemetry" not in fast_app.router.paths
