"""`exitplane[client]` stands on its own: a fresh virtual environment holding only the project
(`pip install --no-deps` of its wheel) and the client's dependencies (pydantic, click, httpx,
msgpack and theirs, copied from this environment's installed distributions: no network) imports
the client without torch, transformers, FastAPI, SQLAlchemy, Celery or numpy being there; and
the decode loop of docs/client.md, run in that environment, ships to a real control plane."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text

from tests.runtime_link.conftest import DEPLOYMENT, EXIT_LAYERS, publish

ROOT = Path(__file__).resolve().parents[2]
# The [client] extra and the base dependencies, with what they depend on in turn.
CLIENT_DISTRIBUTIONS = ["pydantic", "pydantic-core", "annotated-types", "typing-extensions",
                        "typing-inspection", "click", "httpx", "httpcore", "h11", "anyio",
                        "idna", "certifi", "sniffio", "msgpack"]
SERVER_STACK = ["torch", "transformers", "fastapi", "sqlalchemy", "celery", "numpy", "redis",
                "controlplane", "runtime", "workers"]


def _copy_distribution(name: str, site: Path) -> None:
    """Install an already installed distribution into `site` file by file (its RECORD)."""
    try:
        distribution = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return  # e.g. sniffio, no longer needed by newer anyio
    for file in distribution.files or []:
        source = Path(distribution.locate_file(file))
        if source.is_file() and ".." not in file.parts and "__pycache__" not in file.parts:
            target = site / file
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def _build_env() -> dict[str, str]:
    """The environment for building the project's wheel offline: the newest setuptools this
    interpreter can see goes first (a layered venv may shadow it with an older one)."""
    found = []
    for entry in map(Path, sys.path):
        for info in entry.glob("setuptools-*.dist-info") if entry.is_dir() else []:
            version = tuple(int(part) for part in re.findall(r"\d+", info.name)[:2])
            found.append((version, str(entry)))
    env = dict(os.environ)
    if found:
        env["PYTHONPATH"] = max(found)[1]
    return env


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory) -> Path:
    """A venv with the project and the client's dependencies only."""
    base = tmp_path_factory.mktemp("client-venv")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; "
                                "print(sysconfig.get_paths()['purelib'])"], check=True,
                               capture_output=True, text=True).stdout.strip())
    for name in CLIENT_DISTRIBUTIONS:
        _copy_distribution(name, site)
    wheels = base / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(wheels), str(ROOT)], check=True,
                   capture_output=True, timeout=300, env=_build_env())
    [wheel] = wheels.glob("exitplane-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True,
                   timeout=300)
    return python


@pytest.mark.slow
def test_the_client_imports_without_the_server_or_the_engine(client_venv):
    probe = f"""
import importlib.util, json, sys
import exitplane.client.aggregate, exitplane.client.shipper, exitplane.client.thresholds
import exitplane.wire
stack = {SERVER_STACK!r}
print(json.dumps({{"file": exitplane.wire.__file__,
                   "installed": [m for m in stack if importlib.util.find_spec(m) is not None
                                 and m not in ("controlplane", "runtime", "workers")],
                   "imported": [m for m in stack if m in sys.modules]}}))
"""
    out = subprocess.run([str(client_venv), "-c", probe], check=True, capture_output=True,
                         text=True, timeout=120, cwd="/", env={"PATH": os.environ["PATH"]})
    found = json.loads(out.stdout)
    assert found["file"].startswith(str(client_venv.parents[1]))  # the venv's own copy
    assert found["installed"] == [] and found["imported"] == []


@pytest.mark.slow  # builds a virtual environment
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_guide_s_decode_loop_runs(client_venv, control_plane, operator, runtime_token,
                                      engine, tmp_path):
    version = publish(operator, {2: 0.5, 4: 0.5})
    guide = (ROOT / "docs" / "client.md").read_text()
    [example] = re.findall(r"```python\n(.*?)```", guide, flags=re.S)
    assert len(example.strip().splitlines()) < 30
    (tmp_path / "loop.py").write_text(example)
    env = {"PATH": os.environ["PATH"], "EXITPLANE_URL": control_plane.url,
           "EXITPLANE_TOKEN": runtime_token, "EXITPLANE_DEPLOYMENT": DEPLOYMENT,
           "TOKENS": "2000"}
    run = subprocess.run([str(client_venv), "loop.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    counts = httpx.get(f"{control_plane.url}/v1/deployments/{DEPLOYMENT}/telemetry/count",
                       headers={"Authorization": f"Bearer {runtime_token}"}).json()
    assert counts["tokens"] == 2000 and counts["records_sampled"] is True
    assert counts["records"] < 200  # ~1% of the tokens travelled as records
    with engine.connect() as connection:
        exits = dict(connection.execute(text(
            "SELECT layer, sum(exits) FROM rollups WHERE version = :v GROUP BY layer"),
            {"v": version}).all())
    # The pulled thresholds (0.5) let about half the tokens out at the first exit layer.
    assert 800 < exits[EXIT_LAYERS[0]] < 1200 and sum(exits.values()) == 2000
