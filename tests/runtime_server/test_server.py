"""The OpenAI-compatible runtime server on the tiny model: the `openai` client for both
endpoints, streaming and not, batching that does not change greedy text, cancellation, 429,
readiness, and a threshold change that lands mid-stream."""

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from exitplane.wire import ThresholdSetWire
from runtime.server import build_state
from runtime.testing import ascii_tokenizer
from tests.support.network import free_port
from tests.support.runtime_server import EXIT_LAYERS, Served, tiny_state
from tests.support.runtime_server import serve as _serve
from tests.support.runtime_server import tiny_engine as _engine


@pytest.fixture
def served() -> Iterator[Served]:
    yield from _serve(tiny_state())


def test_completion_and_chat_with_usage_and_extension(served):
    completion = served.client.completions.create(model="tiny-llama", prompt="Hello there",
                                                  max_tokens=12, temperature=0)
    assert completion.usage.prompt_tokens == len("Hello there")
    assert completion.usage.completion_tokens == 12
    assert completion.choices[0].finish_reason == "length"
    extension = completion.model_extra["exitplane"]
    assert extension["threshold_version"] == 0 and extension["mean_exit_layer"] == 6.0

    chat = served.client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
        temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 8
    assert [m.id for m in served.client.models.list().data] == ["tiny-llama"]


def test_streaming_matches_the_non_streaming_text(served):
    alone = served.client.completions.create(model="t", prompt="abc", max_tokens=16,
                                             temperature=0)
    whole = alone.choices[0].text
    pieces, final = [], None
    for chunk in served.client.completions.create(model="t", prompt="abc", max_tokens=16,
                                                  temperature=0, stream=True):
        pieces.append(chunk.choices[0].text)
        final = chunk
    assert "".join(pieces) == whole
    assert final.choices[0].finish_reason == alone.choices[0].finish_reason
    assert final.usage.completion_tokens == alone.usage.completion_tokens

    chat_pieces = [c.choices[0].delta.content or "" for c in served.client.chat.completions.create(
        model="t", messages=[{"role": "user", "content": "abc"}], max_tokens=10, temperature=0,
        stream=True)]
    whole_chat = served.client.chat.completions.create(
        model="t", messages=[{"role": "user", "content": "abc"}], max_tokens=10,
        temperature=0).choices[0].message.content
    assert "".join(chat_pieces) == whole_chat


def test_concurrent_requests_return_what_they_return_alone(served):
    prompts = ["The cat", "A much longer prompt about dogs", "x", "Quantum", "zz top", "hey"]
    alone = [served.client.completions.create(model="t", prompt=p, max_tokens=20,
                                              temperature=0).choices[0].text for p in prompts]
    together: dict[int, str] = {}

    def ask(i: int) -> None:
        together[i] = served.client.completions.create(model="t", prompt=prompts[i],
                                                       max_tokens=20,
                                                       temperature=0).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert [together[i] for i in range(len(prompts))] == alone
    assert served.state.metrics.batch_size._sum.get() > len(prompts) * 20 / 2  # rows shared steps


def test_stop_strings_and_sampling(served):
    def complete(prompt: str) -> str:
        return served.client.completions.create(model="t", prompt=prompt, max_tokens=30,
                                                temperature=0).choices[0].text

    prompt, text = next((p, t) for p in ("abc", "hello", "zq", "The", "0123", "Mm")
                        if len(t := complete(p)) >= 10)
    stop = text[5:7]
    stopped = served.client.completions.create(model="t", prompt=prompt, max_tokens=30,
                                               temperature=0, stop=[stop])
    assert stopped.choices[0].text == text[:text.find(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    one = served.client.completions.create(model="t", prompt="abc", max_tokens=20,
                                           temperature=1.0, top_p=0.9, seed=7).choices[0].text
    two = served.client.completions.create(model="t", prompt="abc", max_tokens=20,
                                           temperature=1.0, top_p=0.9, seed=7).choices[0].text
    assert one == two  # seeded sampling is reproducible


def test_bad_requests_get_4xx_with_a_message(served):
    bad = httpx.post(f"{served.url}/v1/completions", json={"prompt": "x", "max_tokens": 0})
    assert bad.status_code == 422 and "max_tokens" in bad.json()["error"]["message"]
    missing = httpx.post(f"{served.url}/v1/chat/completions", json={"messages": []})
    assert missing.status_code == 422
    too_long = httpx.post(f"{served.url}/v1/completions",
                          json={"prompt": "x" * 250, "max_tokens": 100})
    assert too_long.status_code == 422 and "max_seq_len" in too_long.json()["error"]["message"]
    streamed = httpx.post(f"{served.url}/v1/completions",
                          json={"prompt": "x" * 250, "max_tokens": 100, "stream": True})
    assert streamed.status_code == 422  # refused before the stream starts


def test_cancellation_frees_the_slot_and_overload_gets_429():
    state = tiny_state(engine=_engine(max_batch=1), max_queue=0)
    for served in _serve(state):
        with httpx.stream("POST", f"{served.url}/v1/completions", json={
                "prompt": "long", "max_tokens": 200, "stream": True, "temperature": 0,
                "ignore_eos": True}) as first:
            lines = first.iter_lines()
            next(lines)
            busy = httpx.post(f"{served.url}/v1/completions",
                              json={"prompt": "x", "max_tokens": 2})
            assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
        # The client went away: the slot is freed without generating all 200 tokens.
        deadline = time.monotonic() + 20
        while state.worker.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        assert state.worker.in_flight == 0
        assert state.metrics.tokens._value.get() < 200
        after = httpx.post(f"{served.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert after.status_code == 200


def test_threshold_change_mid_stream_takes_effect_on_the_next_step(served):
    engine = served.state.engine
    aggressive = ThresholdSetWire.build(deployment="local", version=2, signal="maxprob",
                                        thresholds={2: 0.0, 4: 0.0})

    records = []

    def swap_after_sixth_token(record) -> None:  # runs in the engine thread, between steps
        records.append(record)
        if record.position == 5:
            engine.set_thresholds(aggressive)

    engine.on_record = swap_after_sixth_token
    chunks = list(served.client.completions.create(model="t", prompt="abc", max_tokens=30,
                                                   temperature=0, stream=True,
                                                   extra_body={"ignore_eos": True}))
    assert [r.threshold_version for r in records] == [0] * 6 + [2] * 24
    assert {r.exit_layer for r in records[6:]} == {2}  # the very next step exits at layer 2
    assert {r.exit_layer for r in records[:6]} == {6}
    assert chunks[-1].model_extra["exitplane"]["threshold_version"] == 2


@pytest.mark.slow
def test_readiness_follows_the_threshold_client(live_server, tokens, engine):
    from sqlalchemy.orm import Session

    from controlplane.auth.service import create_token
    from controlplane.deployments.service import get_deployment

    op = tokens.headers(tokens.operator)
    # generous timeouts: a loaded machine (the whole suite beside it) answers slowly
    created = httpx.post(f"{live_server.url}/v1/deployments", headers=op, timeout=60, json={
        "name": "tiny", "model_ref": "tiny", "num_layers": 6, "exit_layers": EXIT_LAYERS,
        "signal": "maxprob"})
    assert created.status_code == 201, created.text
    with Session(engine) as session:
        _, secret = create_token(session=session, name="rt", scope="runtime",
                                 deployment=get_deployment(session=session, name="tiny"))
        session.commit()
    import tempfile

    # No control plane reachable and no cache: serves never-exit, but reports not ready.
    offline = build_state(engine=_engine(), tokenizer=ascii_tokenizer(), model_name="t",
                          control_plane=f"http://127.0.0.1:{free_port()}", deployment="tiny",
                          token=secret, state_dir=tempfile.mkdtemp())
    for served in _serve(offline):
        offline.thresholds.wait_ready(10)
        assert httpx.get(f"{served.url}/readyz", timeout=60).status_code == 503
        assert httpx.post(f"{served.url}/v1/completions", timeout=60,
                          json={"prompt": "x", "max_tokens": 2}).status_code == 200
    online = build_state(engine=_engine(), tokenizer=ascii_tokenizer(), model_name="t",
                         control_plane=live_server.url, deployment="tiny", token=secret,
                         state_dir=tempfile.mkdtemp())
    for served in _serve(online):
        assert online.thresholds.wait_ready(10)
        ready = httpx.get(f"{served.url}/readyz", timeout=60)
        assert ready.status_code == 200 and ready.json()["threshold_version"] == 1
