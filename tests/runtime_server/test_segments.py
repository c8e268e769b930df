"""Traffic segments through the real runtime server: a request's segment comes from
the X-Exitplane-Segment header, the exitplane_segment body field or a rule (API key, model
name); its tokens apply that segment's thresholds and its records carry the segment; a
malformed name is a 400 with a message; names past the cap run as 'default', and so does a
name of the request's own on a server without API keys (unless the set maps it)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from click.testing import CliRunner

from exitplane.wire import ThresholdSetWire
from runtime.cli import runtime_cli
from runtime.server import build_state
from runtime.serving.segments import SegmentRules, key_digest
from runtime.testing import ascii_tokenizer
from tests.support.runtime_server import EXIT_LAYERS, Served, serve, served_on_a_port, tiny_engine

KEY, CODE_KEY = "k" * 24, "c" * 24
# default never exits; code leaves every token at the first exit layer, chat at the second
SEGMENTED = ThresholdSetWire.build(deployment="local", version=5, signal="maxprob",
                                   thresholds=dict.fromkeys(EXIT_LAYERS, 1.0),
                                   segments={"code": {2: 0.0, 4: 1.0}, "chat": {2: 1.0, 4: 0.0}})
EXIT_AT = {"code": 2, "chat": 4, "default": 6}


def segmented_state(**options):
    return build_state(engine=tiny_engine(), tokenizer=ascii_tokenizer(), model_name="tiny-llama",
                       control_plane=None, deployment=None, token=None, state_dir=None,
                       static_thresholds=SEGMENTED, **options)


@pytest.fixture
def served() -> Iterator[Served]:
    yield from serve(segmented_state(max_segments=3))


def complete(served: Served, *, headers=None, key: str | None = None, chat: bool = False,
             **body) -> httpx.Response:
    body = {"model": "tiny-llama", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            **body}
    if chat:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "Hello"
    headers = dict(headers or {})
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return httpx.post(f"{served.url}{path}", json=body, headers=headers, timeout=30)


def answered_in(served: Served, response: httpx.Response) -> tuple[str, set[int], set[str]]:
    """(the extension's segment, the exit layers it reports, the segments on its records)."""
    assert response.status_code == 200, response.text
    answer = response.json()
    records = [r for r in served.state.engine.drain_records() if r.request_id == answer["id"]]
    assert len(records) == answer["usage"]["completion_tokens"] == 4
    extension = answer["exitplane"]
    return extension["segment"], set(extension["exit_layers"]), {r.segment for r in records}


def test_the_header_or_the_body_field_picks_the_segment_and_its_thresholds(served):
    for segment in ("code", "chat"):
        by_header = complete(served, headers={"X-Exitplane-Segment": segment})
        assert answered_in(served, by_header) == (segment, {EXIT_AT[segment]}, {segment})
        by_body = complete(served, chat=True, exitplane_segment=segment)
        assert answered_in(served, by_body) == (segment, {EXIT_AT[segment]}, {segment})
    # the OpenAI client sends the field as an extra body field
    completion = served.client.completions.create(
        model="tiny-llama", prompt="Hello", max_tokens=3, temperature=0,
        extra_body={"exitplane_segment": "code"})
    assert completion.model_extra["exitplane"]["segment"] == "code"
    assert set(completion.model_extra["exitplane"]["exit_layers"]) == {2}
    # neither: default; the header wins over the body
    assert answered_in(served, complete(served)) == ("default", {6}, {"default"})
    both = complete(served, headers={"X-Exitplane-Segment": "chat"}, exitplane_segment="code")
    assert answered_in(served, both) == ("chat", {4}, {"chat"})


def test_a_streamed_answer_names_its_segment(served):
    with httpx.stream("POST", f"{served.url}/v1/completions", timeout=30,
                      headers={"X-Exitplane-Segment": "code"},
                      json={"prompt": "Hello", "max_tokens": 3, "temperature": 0,
                            "stream": True, "ignore_eos": True}) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
    final = json.loads(events[-1])
    assert final["exitplane"]["segment"] == "code" and set(final["exitplane"]["exit_layers"]) == {2}


@pytest.mark.parametrize(("where", "name"), [("header", "Code"), ("header", ""),
                                             ("body", "chat/../x"), ("body", "a" * 64)])
def test_a_malformed_segment_name_is_a_400_with_a_message(served, where, name):
    options = ({"headers": {"X-Exitplane-Segment": name}} if where == "header"
               else {"exitplane_segment": name})
    response = complete(served, **options)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "is not a segment name" in message and "lowercase" in message
    assert served.state.worker.in_flight == 0


def test_names_past_the_cap_run_as_default_but_the_set_s_own_always_apply():
    # max_segments=3: the set's own names (code, chat) take no slot; three new names do
    with served_on_a_port(segmented_state(api_keys=(KEY,), max_segments=3)) as served:
        for name in ("ops", "tools", "search"):
            named = complete(served, key=KEY, headers={"X-Exitplane-Segment": name})
            assert answered_in(served, named)[0] == name
        late = complete(served, key=KEY, headers={"X-Exitplane-Segment": "retrieval"})
        assert answered_in(served, late) == ("default", {6}, {"default"})
        again = complete(served, key=KEY, headers={"X-Exitplane-Segment": "ops"})  # tracked
        assert answered_in(served, again)[0] == "ops"
        assert answered_in(served, complete(served, key=KEY, exitplane_segment="code"))[0] == \
            "code"
        assert served.state.segments.tracked == {"ops", "tools", "search"}
        metrics = httpx.get(f"{served.url}/metrics").text
        assert "exitplane_runtime_segment_overflow_requests_total 1.0" in metrics
        assert "exitplane_runtime_segments_tracked 3.0" in metrics


def test_a_server_without_keys_takes_only_the_operator_s_names_from_a_request(served):
    """Anyone who reaches a server without API keys could name segments: a name neither the
    applied set nor a rule gives runs as default, and the runtime tracks none."""
    for where in ({"headers": {"X-Exitplane-Segment": "squat"}}, {"exitplane_segment": "squat"}):
        assert answered_in(served, complete(served, **where)) == ("default", {6}, {"default"})
    assert answered_in(served, complete(served, headers={"X-Exitplane-Segment": "code"}))[0] == \
        "code"  # the set maps it: the operator published it
    assert served.state.segments.tracked == frozenset()
    metrics = httpx.get(f"{served.url}/metrics").text
    assert "exitplane_runtime_segment_unkeyed_requests_total 2.0" in metrics


def test_rules_by_api_key_and_by_model_name(tmp_path):
    rules_file = tmp_path / "rules.json"
    rules_file.write_text(json.dumps({"api_keys": {key_digest(CODE_KEY): "code"},
                                      "models": {"tiny-chat": "chat"}}))
    rules = SegmentRules.load(rules_file)
    with served_on_a_port(segmented_state(api_keys=(KEY, CODE_KEY), segment_rules=rules)) as s:
        assert answered_in(s, complete(s, key=CODE_KEY)) == ("code", {2}, {"code"})
        assert answered_in(s, complete(s, key=KEY, model="tiny-chat")) == (
            "chat", {4}, {"chat"})
        assert answered_in(s, complete(s, key=KEY)) == ("default", {6}, {"default"})
        # the API key's rule comes before the model's; the request's own name before both
        assert answered_in(s, complete(s, key=CODE_KEY, model="tiny-chat"))[0] == "code"
        named = complete(s, key=CODE_KEY, headers={"X-Exitplane-Segment": "chat"})
        assert answered_in(s, named)[0] == "chat"


def test_rules_that_cannot_apply_are_refused_at_start(tmp_path):
    rules = SegmentRules(by_api_key={key_digest("x" * 24): "code"})
    with pytest.raises(ValueError, match="does not accept"):
        segmented_state(api_keys=(KEY,), segment_rules=rules)
    with pytest.raises(ValueError, match="need the server's API keys"):
        segmented_state(segment_rules=rules)
    with pytest.raises(ValueError, match="tracks at most 1"):
        segmented_state(segment_rules=SegmentRules(by_model={"a": "x", "b": "y"}),
                        max_segments=1)
    bad = tmp_path / "bad.json"
    thresholds = tmp_path / "thresholds.json"
    thresholds.write_text(json.dumps({"thresholds": {"2": 0.9}}))
    for content, message in ((json.dumps({"api_keys": {KEY: "code"}}), "sha256 hex digest"),
                             (json.dumps({"models": {"m": "Chat"}}), "is not a segment name"),
                             (json.dumps({"model": {}}), "expected a JSON object"),
                             ("{", "segment rules")):
        bad.write_text(content)
        with pytest.raises(ValueError, match=message):
            SegmentRules.load(bad)
        # the CLI says it in one line and exits 2 before loading any model
        result = CliRunner().invoke(runtime_cli, ["serve", "--model", "tiny", "--thresholds",
                                                  str(thresholds), "--segment-rules", str(bad)])
        assert result.exit_code == 2 and message in result.output
