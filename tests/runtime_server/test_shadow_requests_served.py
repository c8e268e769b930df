"""The runtime server serves greedy requests as shadow requests at its engine's rate
(`--shadow-request-rate`, or the control plane's): every token of such a request a
full-depth shadow token marked `shadow_request`, the last `request_end`; a sampled request
is never one."""

from collections.abc import Iterator

import pytest

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
