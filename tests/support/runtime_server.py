"""The runtime server on the tiny model, in-process on a real uvicorn port: shared by
tests/runtime_server/ and the runtime security tests (tests/security/test_runtime_*.py)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import openai
import uvicorn

from exitplane.wire import ThresholdSetWire
from runtime.engine import Engine, EngineConfig
from runtime.model import tiny_llama
from runtime.server import ServeState, build_state, create_serve_app
from runtime.testing import ascii_tokenizer
from tests.support.network import free_port

EXIT_LAYERS = [2, 4]


class Served:
    def __init__(self, state, url: str, server, api_key: str = "unused") -> None:
        self.state, self.url, self.server = state, url, server
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0)


def serve(state: ServeState, api_key: str = "unused") -> Iterator[Served]:
    """Run the app on a free port until the generator is closed."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_serve_app(state), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    yield Served(state, f"http://127.0.0.1:{port}", server, api_key)
    server.should_exit = True
    thread.join(timeout=30)


served_on_a_port = contextlib.contextmanager(serve)


def tiny_engine(max_batch: int = 4, **config) -> Engine:
    return Engine(tiny_llama(seed=3), exit_layers=EXIT_LAYERS,
                  config=EngineConfig(max_batch=max_batch, max_seq_len=256, **config))


def never_exit() -> ThresholdSetWire:
    return ThresholdSetWire.never_exit(deployment="local", signal="maxprob",
                                       exit_layers=EXIT_LAYERS)


def tiny_state(*, engine: Engine | None = None, tokenizer=None, max_queue: int = 8,
               **options) -> ServeState:
    """An offline server state (static never-exit thresholds) on the tiny model."""
    return build_state(engine=engine or tiny_engine(), tokenizer=tokenizer or ascii_tokenizer(),
                       model_name="tiny-llama", control_plane=None, deployment=None, token=None,
                       state_dir=None, static_thresholds=never_exit(), max_queue=max_queue,
                       **options)
