"""exitplane-client stands on its own: its wheel (built from clients/python/) holds the wire
schema and the client and nothing of the server or the engine; the server's wheel depends on it
instead of carrying a copy; a fresh virtual environment holding only that wheel and its
dependencies (pydantic, httpx, msgpack and theirs, copied from this environment's installed
distributions: no network) runs docs/client.md's example verbatim against a real control plane,
which lists the runtime under its own id while it runs, stores its shadow tokens, certifies a
calibrated set from them, and drops the runtime once it has left."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controlplane.auth.service import create_token
from controlplane.calibration import service as calibration
from controlplane.db import session_scope
from controlplane.deployments.models import ThresholdSet
from controlplane.deployments.service import get_deployment
from controlplane.flows import recalibration
from controlplane.telemetry.models import ShadowSampleRow
from tests.support.install import fresh_venv

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "clients" / "python"
# The client's dependencies, with what they depend on in turn.
CLIENT_DISTRIBUTIONS = ["pydantic", "pydantic-core", "annotated-types", "typing-extensions",
                        "typing-inspection", "httpx", "httpcore", "h11", "anyio", "idna",
                        "certifi", "sniffio", "msgpack"]
SERVER_STACK = ["torch", "transformers", "fastapi", "sqlalchemy", "celery", "numpy", "redis",
                "click", "controlplane", "runtime", "workers", "dashboards", "migrations"]


def _build_wheel(source: Path, into: Path) -> Path:
    """`pip wheel` offline (no index, no build isolation, no dependencies)."""
    before = set(into.glob("*.whl")) if into.exists() else set()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-index",
                    "--no-build-isolation", "-w", str(into), str(source)], check=True,
                   capture_output=True, timeout=300)
    [wheel] = set(into.glob("*.whl")) - before
    return wheel


@pytest.fixture(scope="module")
def client_wheel(tmp_path_factory) -> Path:
    return _build_wheel(CLIENT, tmp_path_factory.mktemp("client-wheel"))


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory, client_wheel) -> Path:
    """A venv with the client wheel and its dependencies only."""
    python = fresh_venv(tmp_path_factory.mktemp("client-venv") / "venv", CLIENT_DISTRIBUTIONS)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", "--no-index", str(client_wheel)], check=True,
                   capture_output=True, timeout=300)
    return python


@pytest.mark.slow  # builds a wheel
def test_the_client_wheel_holds_the_client_and_nothing_else(client_wheel):
    names = zipfile.ZipFile(client_wheel).namelist()
    code = [name for name in names if ".dist-info/" not in name]
    assert "exitplane/wire.py" in code and "exitplane/client/runtime.py" in code
    assert all(name == "exitplane/wire.py" or name.startswith("exitplane/client/")
               for name in code), code
    assert "exitplane/__init__.py" not in code and "exitplane/cli.py" not in code
    [info] = [name for name in names if name.endswith(".dist-info/METADATA")]
    requires = [line.split(":", 1)[1].strip() for line in
                zipfile.ZipFile(client_wheel).read(info).decode().splitlines()
                if line.startswith("Requires-Dist:")]
    assert sorted(re.split(r"[<>=!; ]", line)[0] for line in requires) == \
        ["httpx", "msgpack", "pydantic"]


@pytest.mark.slow  # builds a wheel
def test_the_server_wheel_depends_on_the_client_instead_of_copying_it(tmp_path):
    source = tmp_path / "source"  # a clean tree: no build/ left by an earlier build
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for package in ("exitplane", "controlplane", "runtime", "workers", "dashboards",
                    "migrations"):
        shutil.copytree(ROOT / package, source / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    wheel = _build_wheel(source, tmp_path / "wheels")
    names = zipfile.ZipFile(wheel).namelist()
    assert "exitplane/cli.py" in names and "exitplane/__init__.py" in names
    assert not [name for name in names
                if name == "exitplane/wire.py" or name.startswith("exitplane/client/")]
    [info] = [name for name in names if name.endswith(".dist-info/METADATA")]
    text = zipfile.ZipFile(wheel).read(info).decode()
    assert "Requires-Dist: exitplane-client==0.1.0" in text
    assert "Provides-Extra: client" not in text


@pytest.mark.slow
def test_the_client_imports_without_the_server_or_the_engine(client_venv):
    probe = f"""
import importlib.util, json, sys
import exitplane.client, exitplane.client.aio, exitplane.wire
stack = {SERVER_STACK!r}
print(json.dumps({{"file": exitplane.wire.__file__,
                   "installed": [m for m in stack if importlib.util.find_spec(m) is not None],
                   "imported": [m for m in stack if m in sys.modules]}}))
"""
    out = subprocess.run([str(client_venv), "-c", probe], check=True, capture_output=True,
                         text=True, timeout=120, cwd="/", env={"PATH": os.environ["PATH"]})
    found = json.loads(out.stdout)
    assert found["file"].startswith(str(client_venv.parents[1]))  # the venv's own copy
    assert found["installed"] == [] and found["imported"] == []


def _guide_example() -> str:
    guide = (ROOT / "docs" / "client.md").read_text()
    return re.findall(r"```python\n(.*?)```", guide, flags=re.S)[0]


@pytest.mark.slow  # builds a virtual environment, runs the example for seconds
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_guide_s_example_joins_ships_shadow_tokens_calibrates_and_leaves(
        client_venv, control_plane, tokens, engine, tmp_path):
    name, runtime_id = "guide", "guide-pod-1"
    with httpx.Client(base_url=control_plane.url, headers=tokens.headers(tokens.operator),
                      timeout=30) as operator:
        created = operator.post("/v1/deployments", json={
            "name": name, "model_ref": "your-model", "num_layers": 6, "exit_layers": [2, 4],
            "signal": "maxprob", "delta": 0.1, "epsilon": 0.1})
        assert created.status_code == 201, created.text
    with Session(engine) as session:
        _, secret = create_token(session=session, name="guide-runtime", scope="runtime",
                                 deployment=get_deployment(session=session, name=name))
        session.commit()
    (tmp_path / "token").write_text(secret + "\n")
    (tmp_path / "loop.py").write_text(_guide_example())
    env = {"PATH": os.environ["PATH"], "EXITPLANE_URL": control_plane.url,
           "EXITPLANE_TOKEN_FILE": str(tmp_path / "token"), "EXITPLANE_DEPLOYMENT": name,
           "EXITPLANE_RUNTIME_ID": runtime_id, "TOKENS": "6000"}
    fleet_url = f"{control_plane.url}/v1/deployments/{name}/runtimes"
    listed: list[str] = []
    with subprocess.Popen([str(client_venv), "loop.py"], cwd=tmp_path, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as run:
        deadline = time.monotonic() + 120
        while run.poll() is None and time.monotonic() < deadline:
            fleet = httpx.get(fleet_url, headers=tokens.headers(tokens.operator)).json()
            listed = listed or [runtime["runtime_id"] for runtime in fleet]
            time.sleep(0.05)
        out, err = run.communicate(timeout=60)
    assert run.returncode == 0, err
    assert "serving threshold set version" in out and out.rstrip().endswith("left the fleet")
    assert listed == [runtime_id]  # while it ran: under its own id
    assert httpx.get(fleet_url, headers=tokens.headers(tokens.operator)).json() == []  # left

    with Session(engine) as session:
        deployment = get_deployment(session=session, name=name)
        shadow = session.execute(
            select(func.count(), func.min(ShadowSampleRow.runtime_id),
                   func.max(ShadowSampleRow.runtime_id))
            .where(ShadowSampleRow.deployment_id == deployment.id)).one()
    assert 450 < shadow[0] < 750 and shadow[1] == shadow[2] == runtime_id  # ~10% of 6,000

    with session_scope(engine) as session:
        job, _ = calibration.request_calibration(
            session=session, deployment=get_deployment(session=session, name=name),
            actor="test", reason="the guide's runtime", enqueue=False)
        assert calibration.start_job(session=session, job=job)
        job = recalibration.run_calibration(
            session=session, job=job,
            policy=calibration.CalibrationPolicy(min_samples_per_layer=400, seed=0))
        assert job.status == "succeeded", job.status_reason
        # a certified set (its promotion may await an operator: one runtime's evidence)
        assert job.result_version is not None, job.status_reason
        certified = session.scalars(select(ThresholdSet).where(
            ThresholdSet.deployment_id == job.deployment_id,
            ThresholdSet.version == job.result_version)).one()
        assert certified.origin == "calibration"
        assert min(certified.thresholds.values()) < 1.0  # it lets tokens exit
