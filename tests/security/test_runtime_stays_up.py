"""The runtime server stays up and honest. A fault injected inside an engine
step fails only the request(s) it belongs to, with a plain 5xx (or an error event on a stream)
and no internal text; the engine thread serves the next request; a dead engine thread turns
/healthz to 503. All against the real server on a uvicorn port with the tiny model."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from runtime.server import exit_when_engine_dies
from tests.support.runtime_server import served_on_a_port, tiny_state
from tests.support.waiting import wait_until

POISON = "POISON"
INTERNAL = "device-side assert at /build/secret/kernel.cu:42"


def _is_poison(request) -> bool:
    return request.prompt == [ord(c) for c in POISON]  # the ASCII tokenizer: id = code


class EngineKilled(BaseException):
    """Escapes `except Exception`, as a fatal error in the engine thread would."""


def _stream_lines(url: str, body: dict, into: list[str], done: threading.Event) -> None:
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                          timeout=60) as response:
            for line in response.iter_lines():
                if line:
                    into.append(line)
    finally:
        done.set()


def _long_stream(url: str, lines: list[str]) -> threading.Event:
    done = threading.Event()
    threading.Thread(target=_stream_lines, daemon=True, args=(url, {
        "prompt": "steady", "max_tokens": 200, "temperature": 0, "ignore_eos": True},
        lines, done)).start()
    wait_until(lambda: len(lines) >= 3, 30, "the long stream to start")
    return done


def _events(lines: list[str]) -> list:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines]


def _slow_steps(engine, seconds: float = 0.01) -> None:
    """Keep a 200-token stream running for a couple of seconds (the tiny model is fast)."""
    import time

    step = engine.step

    def slow():
        time.sleep(seconds)
        return step()

    engine.step = slow


def _assert_plain_error(response: httpx.Response, status: int) -> None:
    assert response.status_code == status, response.text
    message = response.json()["error"]["message"]
    assert INTERNAL not in message and "Error" not in message and "Traceback" not in message


def test_a_fault_in_one_requests_prefill_fails_that_request_only():
    state = tiny_state()
    engine = state.engine
    prefill = engine._prefill

    def faulty_prefill(request):
        if _is_poison(request):
            raise RuntimeError(INTERNAL)
        return prefill(request)

    engine._prefill = faulty_prefill
    _slow_steps(engine)
    with served_on_a_port(state) as served:
        lines: list[str] = []
        done = _long_stream(served.url, lines)

        failed = httpx.post(f"{served.url}/v1/completions",
                            json={"prompt": POISON, "max_tokens": 4}, timeout=30)
        _assert_plain_error(failed, 500)
        with httpx.stream("POST", f"{served.url}/v1/completions", timeout=30, json={
                "prompt": POISON, "max_tokens": 4, "stream": True}) as stream:
            events = [json.loads(line[6:]) for line in stream.iter_lines() if line]
        assert [set(e) for e in events] == [{"error"}]  # one error event, then the end
        assert INTERNAL not in events[0]["error"]["message"]

        assert done.wait(60), "the concurrent stream hung"
        streamed = _events(lines)
        assert streamed[-1] == "[DONE]"  # the other stream was not touched
        assert streamed[-2]["usage"]["completion_tokens"] == 200
        after = httpx.post(f"{served.url}/v1/completions",
                           json={"prompt": "next", "max_tokens": 5, "temperature": 0})
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 5
        assert httpx.get(f"{served.url}/healthz").status_code == 200


def test_a_fault_in_a_decode_step_fails_that_batch_and_the_engine_serves_on():
    state = tiny_state()
    engine = state.engine
    decode = engine._decode

    def faulty_decode(requests, policy, *rest):
        if any(_is_poison(r) for r in requests):
            raise RuntimeError(INTERNAL)
        return decode(requests, policy, *rest)

    engine._decode = faulty_decode
    _slow_steps(engine)
    with served_on_a_port(state) as served:
        lines: list[str] = []
        done = _long_stream(served.url, lines)
        failed = httpx.post(f"{served.url}/v1/completions",
                            json={"prompt": POISON, "max_tokens": 4}, timeout=30)
        _assert_plain_error(failed, 500)
        # The stream shared the failed step: it ends with an error event instead of hanging.
        assert done.wait(30), "the stream in the failed batch hung"
        last = _events(lines)[-1]
        assert set(last) == {"error"} and last["error"]["code"] == 500
        assert INTERNAL not in last["error"]["message"]

        after = httpx.post(f"{served.url}/v1/completions",
                           json={"prompt": "next", "max_tokens": 5, "temperature": 0})
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 5
        assert httpx.get(f"{served.url}/healthz").json()["engine"] == "running"


def test_a_dead_engine_thread_turns_healthz_to_503_and_fails_requests_fast():
    state = tiny_state()
    engine = state.engine
    decode = engine._decode

    def fatal_decode(requests, policy, *rest):
        if any(_is_poison(r) for r in requests):
            raise EngineKilled("the engine thread is gone")
        return decode(requests, policy, *rest)

    engine._decode = fatal_decode
    _slow_steps(engine)
    with served_on_a_port(state) as served:
        assert httpx.get(f"{served.url}/healthz").status_code == 200
        lines: list[str] = []
        done = _long_stream(served.url, lines)
        killed = httpx.post(f"{served.url}/v1/completions",
                            json={"prompt": POISON, "max_tokens": 4}, timeout=30)
        assert killed.status_code == 503, killed.text
        assert done.wait(30), "a stream hung on the dead engine"
        assert _events(lines)[-1]["error"]["code"] == 503

        health = httpx.get(f"{served.url}/healthz")
        assert health.status_code == 503 and health.json()["engine"] == "stopped"
        later = httpx.post(f"{served.url}/v1/completions",
                           json={"prompt": "hello", "max_tokens": 4}, timeout=10)
        _assert_plain_error(later, 503)
        assert "restart" in later.json()["error"]["message"]


@pytest.mark.parametrize(("field", "value"), [
    ("seed", 2**64), ("seed", -1), ("n", 2), ("temperature", 7.5), ("top_p", 0),
    ("max_tokens", 10**12), ("logprobs", 3), ("presence_penalty", 1e9), ("best_of", 4)])
def test_every_numeric_field_is_bounded_with_a_422_naming_it(field, value):
    with served_on_a_port(tiny_state()) as served:
        response = httpx.post(f"{served.url}/v1/completions", json={
            "prompt": "x", "max_tokens": 3, "temperature": 1.0, field: value})
        assert response.status_code == 422, response.text
        message = response.json()["error"]["message"]
        assert message.startswith(f"{field}: ") and "Overflow" not in message
        chat = httpx.post(f"{served.url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
            "temperature": 1.0, field: value})
        if field not in ("logprobs", "best_of"):  # chat's logprobs is a flag; no best_of
            assert chat.status_code == 422 and field in chat.json()["error"]["message"]
        assert httpx.get(f"{served.url}/healthz").status_code == 200


def test_the_largest_seed_still_samples():
    with served_on_a_port(tiny_state()) as served:
        response = httpx.post(f"{served.url}/v1/completions", json={
            "prompt": "x", "max_tokens": 3, "temperature": 1.0, "seed": 2**63 - 1})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("thresholds", [{2: 1.0, 4: 1.0}, {2: 0.3, 4: 0.0}],
                         ids=["never-exit", "exits-with-lazy-kv"])
def test_after_a_failed_step_the_engine_generates_what_a_fresh_one_does(thresholds):
    """A step that dies half-way (some layers' KV written) drops its rows and frees their
    slots; nothing stale leaks into the next request on those slots."""
    from exitplane.wire import Signal
    from runtime.engine import ExitPolicy, StepFailed
    from tests.support.runtime_server import tiny_engine

    def engine_with_policy():
        engine = tiny_engine(max_batch=2)
        engine.set_thresholds(ExitPolicy(version=1, signal=Signal.maxprob,
                                         thresholds=thresholds))
        return engine

    prompt = [ord(c) for c in "abc"]
    expected = engine_with_policy().generate([prompt], max_new_tokens=12, stop_token_ids=[])
    engine = engine_with_policy()
    engine.add_request(prompt, request_id="a", max_new_tokens=30, stop_token_ids=[])
    engine.add_request([ord(c) for c in "other"], request_id="b", max_new_tokens=30,
                       stop_token_ids=[])
    for _ in range(3):
        engine.step()
    layer = engine.decoder.layer  # every decoder layer of prefill and decode runs here
    calls = []

    def broken_layer(index, *args, **kwargs):
        calls.append(index)
        if len(calls) == 4:  # after three layers of this step wrote their KV
            raise RuntimeError(INTERNAL)
        return layer(index, *args, **kwargs)

    engine.decoder.layer = broken_layer
    with pytest.raises(StepFailed) as failed:
        engine.step()
    assert sorted(failed.value.request_ids) == ["a", "b"]
    assert not engine.has_work and engine.cache.free_slots == 2
    engine.decoder.layer = layer
    assert engine.generate([prompt], max_new_tokens=12, stop_token_ids=[]) == expected


def test_a_hung_step_turns_healthz_to_503_until_it_returns():
    state = tiny_state(stuck_after_s=0.5)
    engine = state.engine
    step, release, entered = engine.step, threading.Event(), threading.Event()

    def hanging_step():
        if any(_is_poison(r) for r in engine._waiting.values()):
            entered.set()
            release.wait(60)  # a device that stopped answering
        return step()

    engine.step = hanging_step
    with served_on_a_port(state) as served:
        answer: list[httpx.Response] = []
        thread = threading.Thread(daemon=True, target=lambda: answer.append(httpx.post(
            f"{served.url}/v1/completions", json={"prompt": POISON, "max_tokens": 3},
            timeout=60)))
        thread.start()
        try:
            assert entered.wait(30)
            stuck = wait_until(lambda: (r := httpx.get(f"{served.url}/healthz")).status_code
                               == 503 and r, 30, "/healthz to report the hung step")
            assert stuck.json()["engine"] == "stuck"
        finally:
            release.set()
        thread.join(60)
        assert answer[0].status_code == 200
        assert httpx.get(f"{served.url}/healthz").status_code == 200


def test_after_the_engine_dies_the_server_stops_so_a_restart_policy_revives_it():
    state = tiny_state()
    engine = state.engine
    step = engine.step

    def fatal_step():
        if any(_is_poison(r) for r in engine._waiting.values()):
            raise EngineKilled("gone")
        return step()

    engine.step = fatal_step
    with served_on_a_port(state) as served:
        exit_when_engine_dies(state, served.server, grace_s=1.0)
        assert httpx.post(f"{served.url}/v1/completions",
                          json={"prompt": POISON, "max_tokens": 2}).status_code == 503
        assert httpx.get(f"{served.url}/healthz").status_code == 503  # during the grace
        wait_until(lambda: served.server.should_exit, 30, "the server to be told to exit")


def test_a_normal_shutdown_does_not_count_as_engine_death():
    state = tiny_state()
    with served_on_a_port(state) as served:
        watcher = exit_when_engine_dies(state, served.server, grace_s=0.0)
    watcher.join(10)
    assert not watcher.is_alive() and state.worker.failure is None
