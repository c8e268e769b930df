"""`AsyncRuntime` has `Runtime`'s public surface: the same attribute and method names, what
blocks on Runtime a coroutine, the rest the wrapped Runtime's own (read and set through it);
and docs/client.md's asyncio loop runs as written against a real control plane: it starts,
waits until a set is applied, reports every token with shadow tokens, and leaves."""

from __future__ import annotations

import asyncio
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controlplane.deployments.service import get_deployment
from controlplane.telemetry.models import ShadowSampleRow
from exitplane.client import AsyncRuntime, Runtime
from exitplane.wire import ThresholdSetWire
from tests.support.runtime_link import DEPLOYMENT, EXIT_LAYERS, NUM_LAYERS, publish

ROOT = Path(__file__).resolve().parents[2]
BLOCKING = {"start", "wait_ready", "flush", "heartbeat", "close"}
# the asyncio variant's own: listeners that may be coroutine functions, and its constructor
OWN = {"on_change", "on_refused", "on_error", "from_env"}


def _public(obj) -> set[str]:
    return {name for name in dir(obj) if not name.startswith("_")}


@pytest.fixture
def offline(tmp_path) -> dict:
    path = tmp_path / "set.json"
    path.write_text(ThresholdSetWire.build(deployment=DEPLOYMENT, version=3, signal="maxprob",
                                           thresholds={2: 0.9, 4: 0.8}).model_dump_json())
    return {"deployment": DEPLOYMENT, "num_layers": NUM_LAYERS, "exit_layers": [4, 2],
            "offline_file": path, "file_check_s": 3600}


def test_the_async_runtime_has_the_runtime_s_public_names(offline):
    rt = Runtime(runtime_id="sync-1", **offline)
    art = AsyncRuntime(runtime_id="async-1", **offline)
    assert _public(art) - _public(rt) == {"runtime"}  # the wrapped Runtime
    assert _public(rt) - _public(art) == set()
    for name in _public(rt):
        on_runtime, on_async = getattr(Runtime, name, None), getattr(AsyncRuntime, name)
        if name in BLOCKING:
            assert inspect.iscoroutinefunction(on_async), name
        elif name not in OWN and inspect.isfunction(on_runtime):
            assert getattr(art, name) == getattr(art.runtime, name), name  # its bound method
        assert not inspect.iscoroutinefunction(on_runtime), name


def test_the_async_runtime_reads_and_sets_through_the_runtime(offline):
    async def run() -> None:
        art = AsyncRuntime(runtime_id="async-1", shadow_rate=0.5, **offline)
        assert await art.wait_ready(0) is False  # nothing applied before start
        async with art as rt:
            assert await rt.wait_ready(1) is True
            assert (rt.runtime_id, rt.num_layers, rt.exit_layers) == ("async-1", NUM_LAYERS,
                                                                     EXIT_LAYERS)
            assert rt.version == 3 and rt.threshold_set.version == 3
            assert rt.exit_layer({2: 0.95, 4: 0.1}, rt.thresholds_for()) == (2, 0.95)
            assert rt.shadow_rate == 0.5
            rt.shadow_rate = 0.0
            assert rt.runtime.shadow_rate == 0.0 and not rt.should_shadow()
            assert rt.record(request_id="r", position=0, exit_layer=2, signal_value=0.95) \
                is False  # offline: counted, not shipped
            assert rt.metrics["dropped_offline"] == rt.dropped_offline == 1
            with pytest.raises(AttributeError):
                rt.version = 7  # a property of the Runtime, read-only there too

    asyncio.run(run())


def _guide_async_loop() -> str:
    guide = (ROOT / "docs" / "client.md").read_text()
    [loop] = [block for block in re.findall(r"```python\n(.*?)```", guide, flags=re.S)
              if "AsyncRuntime.from_env" in block and "asyncio.run" in block]
    return loop


@pytest.mark.slow  # a control plane, a subprocess running the guide's loop for seconds
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_guide_s_async_loop_runs_as_written(control_plane, operator, runtime_token, engine,
                                               tmp_path):
    version = publish(operator, {2: 0.9, 4: 0.9})
    (tmp_path / "token").write_text(runtime_token + "\n")
    (tmp_path / "loop.py").write_text(_guide_async_loop())
    env = {"PATH": os.environ["PATH"], "EXITPLANE_URL": control_plane.url,
           "EXITPLANE_TOKEN_FILE": str(tmp_path / "token"), "EXITPLANE_DEPLOYMENT": DEPLOYMENT,
           "EXITPLANE_RUNTIME_ID": "guide-async-1", "TOKENS": "2000"}
    run = subprocess.run([sys.executable, "loop.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"serving threshold set version {version}" in run.stdout
    assert run.stdout.rstrip().endswith("left the fleet")
    fleet = httpx.get(f"{control_plane.url}/v1/deployments/{DEPLOYMENT}/runtimes",
                      headers=operator.headers)
    assert fleet.json() == []
    with Session(engine) as session:
        deployment = get_deployment(session=session, name=DEPLOYMENT)
        shadow, runtime_id = session.execute(
            select(func.count(), func.max(ShadowSampleRow.runtime_id))
            .where(ShadowSampleRow.deployment_id == deployment.id)).one()
    assert 100 < shadow < 320 and runtime_id == "guide-async-1"  # ~10% of 2,000
