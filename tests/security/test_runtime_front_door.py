"""The runtime server is not an open door. API keys on every /v1 route
(probes and metrics stay open), a body limit enforced before parsing, prompt length checked
before tokenizing and tokenizing off the event loop, stop strings capped. Real server on a
uvicorn port with the tiny model, plus `exitplane runtime serve` as a process for the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from runtime.serving.schemas import MAX_STOP_CHARS
from runtime.testing import ascii_tokenizer
from tests.support.network import free_port
from tests.support.runtime_server import served_on_a_port, tiny_engine, tiny_state
from tests.support.waiting import wait_until

KEY = "k-" + "q1r2s3t4" * 4
OTHER_KEY = "k-" + "z9y8x7w6" * 4
ROUTES = [("GET", "/v1/models", None),
          ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
          ("POST", "/v1/chat/completions",
           {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})]


def _unauthorized(response: httpx.Response) -> bool:
    error = response.json()["error"]
    return (response.status_code == 401 and error["code"] == "invalid_api_key"
            and "Authorization: Bearer" in error["message"]
            and response.headers["www-authenticate"] == "Bearer")


def test_every_v1_route_needs_a_key_when_keys_are_set():
    with served_on_a_port(tiny_state(api_keys=(KEY, OTHER_KEY)), api_key=KEY) as served:
        for method, path, body in ROUTES:
            url = f"{served.url}{path}"
            assert _unauthorized(httpx.request(method, url, json=body)), path
            assert _unauthorized(httpx.request(method, url, json=body,
                                               headers={"Authorization": f"Bearer {KEY}x"}))
            assert _unauthorized(httpx.request(method, url, json=body,
                                               headers={"Authorization": f"Basic {KEY}"}))
            for key in (KEY, OTHER_KEY):
                ok = httpx.request(method, url, json=body,
                                   headers={"Authorization": f"Bearer {key}"})
                assert ok.status_code == 200, (path, ok.text)
        # unknown paths and the OpenAPI document are behind the key too
        assert httpx.get(f"{served.url}/openapi.json").status_code == 401
        assert httpx.get(f"{served.url}/v2/anything").status_code == 401
        for open_path in ("/healthz", "/readyz", "/metrics"):
            assert httpx.get(f"{served.url}{open_path}").status_code == 200, open_path
        # the OpenAI client sends the key the way the server expects it
        assert served.client.completions.create(model="t", prompt="hi", max_tokens=2,
                                                temperature=0).usage.completion_tokens == 2
        wrong = openai.OpenAI(base_url=f"{served.url}/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()


@pytest.mark.slow
def test_the_serve_command_takes_keys_from_a_file_and_the_environment(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text(f"# one key per line\n{KEY}\n\n")
    thresholds = tmp_path / "thresholds.json"
    thresholds.write_text(json.dumps({"signal": "maxprob", "thresholds": {"2": 1.0, "4": 1.0}}))
    port = free_port()
    env = {**os.environ, "EXITPLANE_RUNTIME_API_KEYS": f"{OTHER_KEY}, "}
    command = [sys.executable, "-m", "exitplane.cli", "runtime", "serve", "--model", "tiny",
               "--thresholds", str(thresholds), "--port", str(port), "--state-dir",
               str(tmp_path / "state"), "--api-key-file", str(key_file)]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            assert process.poll() is None, process.stdout.read().decode()
            try:
                return httpx.get(f"{url}/healthz").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, 120, "exitplane runtime serve to start")
        assert _unauthorized(httpx.get(f"{url}/v1/models"))
        for key in (KEY, OTHER_KEY):
            assert httpx.get(f"{url}/v1/models",
                             headers={"Authorization": f"Bearer {key}"}).status_code == 200
    finally:
        process.terminate()
        process.wait(30)

    # The compose override names the file through the environment instead of the flag.
    key_file.write_text("# nothing but a comment\n")
    without_flag = command[:command.index("--api-key-file")]
    refused = subprocess.run(without_flag, env={**env, "EXITPLANE_RUNTIME_API_KEY_FILE":
                                                 str(key_file)},
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "holds no API key" in refused.stderr


def test_a_body_over_the_limit_is_refused_before_parsing():
    with served_on_a_port(tiny_state(max_body_bytes=64 * 1024)) as served:
        big = json.dumps({"prompt": "x" * 100_000, "max_tokens": 2}).encode()
        declared = httpx.post(f"{served.url}/v1/completions", content=big,
                              headers={"Content-Type": "application/json"})
        assert declared.status_code == 413
        assert "--max-body-bytes" in declared.json()["error"]["message"]

        def chunks():  # no Content-Length: the limit is counted while reading
            for start in range(0, len(big), 8192):
                yield big[start:start + 8192]

        chunked = httpx.post(f"{served.url}/v1/completions", content=chunks(),
                             headers={"Content-Type": "application/json"})
        assert chunked.status_code == 413
        small = httpx.post(f"{served.url}/v1/completions", content=json.dumps(
            {"prompt": "x" * 100, "max_tokens": 2}).encode(),
            headers={"Content-Type": "application/json"})
        assert small.status_code == 200


def test_a_deeply_nested_body_is_refused_before_parsing():
    """Within the size limit, a body nested past the JSON depth limit never reaches the
    decoder: a clean 422 in the OpenAI error shape, on both generation routes."""
    with served_on_a_port(tiny_state()) as served:
        for path, deep in (("/v1/completions", b'{"prompt":' + b"[" * 200_000),
                           ("/v1/chat/completions",
                            b'{"messages":[{"role":"user","content":' + b'{"a":' * 50_000)):
            answer = httpx.post(f"{served.url}{path}", content=deep,
                                headers={"Content-Type": "application/json"})
            assert answer.status_code == 422, answer.text
            assert "nests deeper than" in answer.json()["error"]["message"]
        nested_prompt = httpx.post(f"{served.url}/v1/completions",
                                   json={"prompt": [[1, 2]], "max_tokens": 2})
        assert nested_prompt.status_code in (200, 422)  # decoded and judged by the schema
        assert "nests deeper" not in nested_prompt.text


def test_the_default_body_limit_is_one_mebibyte():
    with served_on_a_port(tiny_state(max_prompt_chars=10**7)) as served:
        over = httpx.post(f"{served.url}/v1/completions",
                          json={"prompt": "x" * (1 << 20), "max_tokens": 2})
        assert over.status_code == 413 and "over 1048576 bytes" in over.json()["error"]["message"]
        under = httpx.post(f"{served.url}/v1/completions",
                           json={"prompt": "x" * 200_000, "max_tokens": 2})
        assert under.status_code == 422  # read and tokenized: too many tokens for the model


def test_a_prompt_over_the_character_limit_is_refused_unread():
    with served_on_a_port(tiny_state(max_prompt_chars=1000)) as served:
        long = httpx.post(f"{served.url}/v1/completions",
                          json={"prompt": "x" * 1001, "max_tokens": 2})
        assert long.status_code == 413 and "1001 characters" in long.json()["error"]["message"]
        chat = httpx.post(f"{served.url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "y" * 600}] * 2, "max_tokens": 2})
        assert chat.status_code == 413
        many_empty = httpx.post(f"{served.url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": ""}] * 200, "max_tokens": 2})
        assert many_empty.status_code == 413


class GatedTokenizer:
    """The real tokenizer, except that encoding a long text waits until the test releases it:
    the test, not the machine's speed, decides how long tokenizing a huge prompt takes."""

    def __init__(self, tokenizer, *, longer_than: int) -> None:
        self._tokenizer = tokenizer
        self.longer_than = longer_than
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, text, **kwargs):
        if len(text) > self.longer_than:
            self.entered.set()
            self.release.wait(60)
        return self._tokenizer(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_tokenizing_a_huge_prompt_does_not_stall_a_concurrent_stream():
    tokenizer = GatedTokenizer(ascii_tokenizer(), longer_than=10_000)
    engine = tiny_engine()
    step = engine.step
    engine.step = lambda: (time.sleep(0.01), step())[1]  # a stream that lasts seconds
    state = tiny_state(engine=engine, tokenizer=tokenizer, max_prompt_chars=500_000)
    with served_on_a_port(state) as served:
        lines: list[str] = []
        done = threading.Event()

        def stream_lines() -> None:
            with httpx.stream("POST", f"{served.url}/v1/completions", timeout=60, json={
                    "prompt": "steady", "max_tokens": 240, "temperature": 0,
                    "ignore_eos": True, "stream": True}) as response:
                for line in response.iter_lines():
                    if line:
                        lines.append(line)
            done.set()

        threading.Thread(target=stream_lines, daemon=True).start()
        wait_until(lambda: len(lines) >= 3, 30, "the stream to start")
        answer: list[httpx.Response] = []
        huge = threading.Thread(daemon=True, target=lambda: answer.append(httpx.post(
            f"{served.url}/v1/completions", json={"prompt": "z" * 400_000, "max_tokens": 2},
            timeout=90)))
        huge.start()
        try:
            assert tokenizer.entered.wait(30), "the huge prompt was never tokenized"
            seen = len(lines)
            # While the huge prompt sits in the tokenizer, the other stream keeps flowing.
            wait_until(lambda: len(lines) >= seen + 20, 30,
                       "the stream to progress while a prompt is tokenized")
        finally:
            tokenizer.release.set()
        huge.join(60)
        assert answer[0].status_code == 422 and "max_seq_len" in answer[0].text
        assert done.wait(60)
        assert lines[-1] == "data: [DONE]"


class GatedDecoder:
    """The real tokenizer whose next decode, once armed, waits until the test releases it."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.armed, self.entered, self.release = False, threading.Event(), threading.Event()

    def decode(self, ids, **kwargs):
        if self.armed:
            self.armed = False
            self.entered.set()
            self.release.wait(60)
        return self._tokenizer.decode(ids, **kwargs)

    def __call__(self, text, **kwargs):
        return self._tokenizer(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_detokenizing_runs_off_the_event_loop():
    tokenizer = GatedDecoder(ascii_tokenizer())
    with served_on_a_port(tiny_state(tokenizer=tokenizer)) as served:
        tokenizer.armed = True
        answer: list[httpx.Response] = []
        thread = threading.Thread(daemon=True, target=lambda: answer.append(httpx.post(
            f"{served.url}/v1/completions", timeout=90, json={
                "prompt": "abc", "max_tokens": 4, "ignore_eos": True, "temperature": 0})))
        thread.start()
        try:
            assert tokenizer.entered.wait(30), "nothing was detokenized"
            # a decode is stuck: the event loop still answers
            assert httpx.get(f"{served.url}/healthz", timeout=20).status_code == 200
        finally:
            tokenizer.release.set()
        thread.join(60)
        assert answer[0].status_code == 200 and answer[0].json()["usage"][
            "completion_tokens"] == 4


def test_stop_strings_are_capped_in_count_and_length():
    with served_on_a_port(tiny_state()) as served:
        too_long = httpx.post(f"{served.url}/v1/completions", json={
            "prompt": "x", "max_tokens": 2, "stop": ["s" * (MAX_STOP_CHARS + 1)]})
        assert too_long.status_code == 422
        assert too_long.json()["error"]["message"].startswith("stop: ")
        assert f"at most {MAX_STOP_CHARS} characters" in too_long.json()["error"]["message"]
        too_many = httpx.post(f"{served.url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
            "stop": ["a", "b", "c", "d", "e"]})
        assert too_many.status_code == 422 and "stop" in too_many.json()["error"]["message"]
        longest = httpx.post(f"{served.url}/v1/completions", json={
            "prompt": "x", "max_tokens": 2, "stop": ["s" * MAX_STOP_CHARS]})
        assert longest.status_code == 200


def test_seed_overflow_is_a_clean_422():
    with served_on_a_port(tiny_state()) as served:
        response = httpx.post(f"{served.url}/v1/completions", json={
            "prompt": "x", "max_tokens": 2, "temperature": 0.7, "seed": 2**64})
        assert response.status_code == 422
        assert response.json()["error"]["message"] == (
            "seed: Input should be less than or equal to 9223372036854775807")
