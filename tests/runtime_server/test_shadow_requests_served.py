"""The runtime server serves greedy requests as shadow requests at its engine's rate
(`--shadow-request-rate`, or the control plane's): every token of such a request a
full-depth shadow token marked `shadow_request`, the last `request_end`; a sampled request
is never one."""

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.runtime_server import Served, tiny_engine, tiny_state
from tests.support.runtime_server import serve as _serve


@pytest.fixture
def served() -> Iterator[Served]:
    yield from _serve(tiny_state(engine=tiny_engine(shadow_request_rate=1.0)))


def test_greedy_requests_are_served_as_shadow_requests(served):
    engine = served.state.engine
    completion = served.client.completions.create(model="tiny-llama", prompt="Hello",
                                                  max_tokens=5, temperature=0)
    assert completion.usage.completion_tokens == 5
    records = engine.drain_records()
    assert [r.position for r in records] == list(range(5))
    assert all(r.shadow_request and r.exit_layer == 6 and r.shadow for r in records)
    assert [r.request_end for r in records] == [False] * 4 + [True]

    served.client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=3,
                                     temperature=0.8, seed=1)
    sampled = engine.drain_records()
    assert len(sampled) == 3 and not any(r.shadow_request or r.request_end for r in sampled)

    engine.config.shadow_request_rate = 0.0  # what the control plane's rate of 0 sets
    served.client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=2,
                                     temperature=0)
    assert not any(r.shadow_request for r in engine.drain_records())

    # /metrics counts what measuring cost: 5 shadow tokens of one finished shadow request
    families = {family.name: sum(s.value for s in family.samples if s.name.endswith("_total"))
                for family in text_string_to_metric_families(
                    httpx.get(f"{served.url}/metrics", timeout=10).text)}
    assert families["exitplane_runtime_shadow_requests"] == 1
    assert families["exitplane_runtime_shadow_tokens"] == 5
    assert families["exitplane_runtime_tokens"] == 10
