"""The runtime <-> control plane link: a control plane that can be stopped and
started again on the same port, a deployment matching the tiny test model, runtime tokens."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from controlplane.auth.service import create_token
from controlplane.deployments.service import get_deployment
from exitplane.client.shipper import TelemetryShipper
from exitplane.wire import ShadowPoint, TokenRecord
from tests.support.network import free_port

DEPLOYMENT = "tiny"
NUM_LAYERS = 6
EXIT_LAYERS = [2, 4]  # runtime.engine.default_exit_layers(6)


@dataclass
class ControlPlane:
    """The real API served by uvicorn in a thread; stop() and start() keep the port and DB.

    Each start builds a fresh app on the same database, as a restarted process would."""

    make_app: Callable[[], object]
    port: int
    _server: object = None
    _thread: threading.Thread | None = None
    apps: list = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ControlPlane:
        import uvicorn

        app = self.make_app()
        self.apps.append(app)
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="off", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 15
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the control plane did not start on port {self.port}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout=15)
        if self._thread.is_alive():
            raise RuntimeError("the control plane did not stop")
        self._server = None

    def close(self) -> None:
        self.stop()
        for app in self.apps:
            app.state.config_delivery.close()


@pytest.fixture
def control_plane(settings, engine) -> Iterator[ControlPlane]:
    """A running control plane on a free port that a test may stop and restart."""
    from exitplane.app import create_app

    plane = ControlPlane(make_app=lambda: create_app(settings, engine=engine), port=free_port())
    plane.start()
    yield plane
    plane.close()


@pytest.fixture
def operator(control_plane, tokens) -> Iterator[httpx.Client]:
    """An operator's HTTP client on the control plane, with the tiny deployment created."""
    with httpx.Client(base_url=control_plane.url, headers=tokens.headers(tokens.operator),
                      timeout=30) as http:
        created = http.post("/v1/deployments", json={
            "name": DEPLOYMENT, "model_ref": "tiny-llama", "num_layers": NUM_LAYERS,
            "exit_layers": EXIT_LAYERS, "signal": "maxprob"})
        assert created.status_code == 201, created.text
        yield http


@pytest.fixture
def runtime_token(engine, operator) -> str:
    """A runtime-scoped token for the tiny deployment."""
    with Session(engine) as session:
        target = get_deployment(session=session, name=DEPLOYMENT)
        _, secret = create_token(session=session, name="rt-tiny", scope="runtime",
                                 deployment=target)
        session.commit()
    return secret


def publish(http: httpx.Client, thresholds: dict[int, float], *, activate: bool = True) -> int:
    """Publish (and by default activate) a set on the tiny deployment; returns its version."""
    response = http.post(f"/v1/deployments/{DEPLOYMENT}/threshold-sets", json={
        "thresholds": {str(k): v for k, v in thresholds.items()}, "reason": "test",
        "activate": activate})
    assert response.status_code == 201, response.text
    return response.json()["version"]


# The rollup columns a test compares, in the order it reads them.
ROLLUP = ("version, minute, layer, tokens, exits, shadow_total, shadow_matches, policy_exits, "
          "policy_mismatches")


def token_stream(count: int, *, versions: list[int], seed: int = 7,
                 start: float | None = None) -> list[TokenRecord]:
    """A realistic mix: most tokens exit at 2 or 4, some run to full depth, 5% are shadow
    tokens (full depth, labelled at every exit layer), spread over three minutes."""
    rng = random.Random(seed)
    start = start if start is not None else (time.time() // 60 - 3) * 60
    records = []
    for index in range(count):
        shadow = rng.random() < 0.05
        exit_layer = NUM_LAYERS if shadow else rng.choices([*EXIT_LAYERS, NUM_LAYERS],
                                                           [5, 3, 2])[0]
        points = [ShadowPoint(layer=layer, signal=rng.random(), matched=rng.random() < 0.7)
                  for layer in EXIT_LAYERS] if shadow else None
        records.append(TokenRecord(
            threshold_version=rng.choice(versions), request_id=f"r{index // 20}",
            position=index % 20, exit_layer=exit_layer,
            signal_value=1.0 if index % 97 == 0 else rng.random(), latency_us=100,
            ts=start + 180 * index / count, shadow=points))
    return records


def stored_rollups(engine, runtime_id: str) -> tuple[list, list]:
    """(rollup rows, histogram rows) the store holds of runtime `runtime_id`, in key order."""
    with engine.connect() as connection:
        rollups = connection.execute(text(
            f"SELECT {ROLLUP} FROM rollups WHERE runtime_id = :r ORDER BY version, minute, layer"),
            {"r": runtime_id}).all()
        histogram = connection.execute(text(
            "SELECT version, minute, layer, bin, count FROM rollup_histograms "
            "WHERE runtime_id = :r ORDER BY version, minute, layer, bin"),
            {"r": runtime_id}).all()
    return [tuple(row) for row in rollups], [tuple(row) for row in histogram]


def fast_shipper(url: str, token: str, spool, runtime_id: str, **options) -> TelemetryShipper:
    """A shipper for the tiny deployment that batches and retries quickly (`options` override)."""
    return TelemetryShipper(base_url=url, token=token, deployment=DEPLOYMENT,
                            runtime_id=runtime_id, num_layers=NUM_LAYERS, spool_dir=spool,
                            **{"batch_records": 500, "batch_interval_s": 0.05,
                               "backoff_initial_s": 0.05, "backoff_max_s": 0.2, "fsync": False,
                               **options})


@pytest.fixture(scope="session")
def tiny_model():
    from runtime.model import tiny_llama

    return tiny_llama(num_layers=NUM_LAYERS)


@pytest.fixture
def make_engine(tiny_model):
    """Build an early-exit engine over the tiny model (exit layers 2 and 4, maxprob)."""
    from runtime.engine import Engine, EngineConfig

    def build(*, shadow_rate: float = 0.0, **kwargs):
        config = EngineConfig(max_batch=4, max_seq_len=128, shadow_rate=shadow_rate)
        return Engine(tiny_model, exit_layers=EXIT_LAYERS, config=config, **kwargs)

    return build
