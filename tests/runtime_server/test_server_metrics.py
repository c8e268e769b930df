"""The runtime server's request metrics, read from its real /metrics endpoint after requests
through the OpenAI client: vLLM-style TTFT, inter-token and end-to-end histograms, prompt and
generation token counters, all labelled with the served model."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from runtime.server import build_state
from runtime.testing import ascii_tokenizer
from tests.support.runtime_server import never_exit, served_on_a_port, tiny_engine


def _samples(url: str) -> dict[tuple[str, tuple], float]:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_latency_histograms_and_token_counters_by_model():
    state = build_state(engine=tiny_engine(), tokenizer=ascii_tokenizer(),
                        model_name="tiny-llama", control_plane=None, deployment=None,
                        token=None, state_dir=None,
                        static_thresholds=never_exit(), max_queue=8)
    with served_on_a_port(state) as served:
        model = (("model_name", "tiny-llama"),)
        before = _samples(served.url)
        assert before[("exitplane_runtime_time_to_first_token_seconds_count", model)] == 0
        served.client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=7,
                                         temperature=0, extra_body={"ignore_eos": True})
        stream = served.client.completions.create(model="tiny-llama", prompt="abc", max_tokens=5,
                                                  temperature=0, stream=True,
                                                  extra_body={"ignore_eos": True})
        assert len(list(stream)) >= 5
        after = _samples(served.url)

    assert after[("exitplane_runtime_time_to_first_token_seconds_count", model)] == 2
    assert after[("exitplane_runtime_e2e_request_latency_seconds_count", model)] == 2
    # one gap between each pair of consecutive tokens: 6 + 4
    assert after[("exitplane_runtime_inter_token_latency_seconds_count", model)] == 10
    assert after[("exitplane_runtime_prompt_tokens_total", model)] == len("Hello") + len("abc")
    assert after[("exitplane_runtime_generation_tokens_total", model)] == 12
    ttft_sum = after[("exitplane_runtime_time_to_first_token_seconds_sum", model)]
    e2e_sum = after[("exitplane_runtime_e2e_request_latency_seconds_sum", model)]
    assert 0 < ttft_sum < e2e_sum
    # vLLM's bucket edges, so its dashboards' quantile queries read the same
    assert ("exitplane_runtime_time_to_first_token_seconds_bucket",
            (("le", "0.001"), ("model_name", "tiny-llama"))) in after
