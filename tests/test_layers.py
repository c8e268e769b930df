"""The layers the code keeps (`.importlinter`, `clients/python/.importlinter`, checked by
scripts/layers.py): every contract holds on this tree, and each kind of contract does refuse an
import that crosses it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("exitplane", "controlplane", "dashboards", "workers", "runtime")
LINT = ("import sys, importlinter.cli as cli; "
        "sys.exit(cli.lint_imports(config_filename=sys.argv[1]))")


def _lint(config: Path, cwd: Path, path: list[str], *, no_site: bool = False):
    site = list(dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib")))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, *site])}
    flags = ["-S"] if no_site else []
    return subprocess.run([sys.executable, *flags, "-c", LINT, str(config)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def _product_copy(tmp_path: Path) -> Path:
    """This tree's product packages and contracts under `tmp_path` (sources only)."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    return tmp_path


@pytest.mark.slow  # a process over the whole tree; `make test` also runs scripts/layers.py
def test_every_contract_holds_on_this_tree():
    run = subprocess.run([sys.executable, "-m", "scripts.layers"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "broken" in run.stdout and " 0 broken" in run.stdout


def test_the_copy_of_this_tree_keeps_its_contracts(tmp_path):
    # the baseline the next two tests break: the copy alone is checked, not this checkout
    root = _product_copy(tmp_path)
    run = _lint(root / ".importlinter", root, [str(root)], no_site=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


@pytest.mark.parametrize(("module", "imported", "broken"), [
    ("controlplane/db.py", "import dashboards.app", "The product in layers"),
    ("controlplane/deployments/models.py", "import controlplane.calibration.models",
     "The control plane in layers"),
    ("exitplane/kit/logs.py", "import controlplane.settings", "The product in layers"),
    ("runtime/kv.py", "import controlplane.db", "The product in layers"),
    ("controlplane/errors.py", "import runtime.kv", "The product in layers"),
    ("workers/app.py", "import dashboards.app", "The product in layers"),
    ("workers/tasks/drift.py", "import controlplane.alerts.api", "The workers are thin"),
    ("workers/tasks/drift.py", "import controlplane.guards.rates", "The workers are thin"),
    ("workers/tasks/alerts.py", "import fastapi", "The workers speak no HTTP"),
])
def test_an_import_against_the_layers_breaks_a_contract(tmp_path, module, imported, broken):
    root = _product_copy(tmp_path)
    target = root / module
    target.write_text(target.read_text() + f"\n{imported}  # noqa\n")
    run = _lint(root / ".importlinter", root, [str(root)], no_site=True)
    assert run.returncode == 1, run.stdout[-4000:]
    assert f"{broken}" in run.stdout
    assert "BROKEN" in run.stdout


def test_the_client_importing_the_control_plane_breaks_its_contract(tmp_path):
    client = tmp_path / "python"
    shutil.copytree(ROOT / "clients" / "python" / "src", client / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "clients" / "python" / ".importlinter", client / ".importlinter")
    kept = _lint(client / ".importlinter", client, [str(client / "src")], no_site=True)
    assert kept.returncode == 0, kept.stdout[-4000:]
    shipper = client / "src" / "exitplane" / "client" / "shipper.py"
    shipper.write_text(shipper.read_text() + "\nimport controlplane.db  # noqa\n")
    broken = _lint(client / ".importlinter", client, [str(client / "src")], no_site=True)
    assert broken.returncode == 1, broken.stdout[-4000:]
    assert "The client stands alone" in broken.stdout and "BROKEN" in broken.stdout
