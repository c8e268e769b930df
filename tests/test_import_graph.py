"""The product code's import graph (scripts/import_graph.py): no cycle, nothing from
`controlplane` into `workers`; and the script does see a cycle and an upward import."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# scripts/ is not an installed package and pytest runs with --import-mode=importlib (the repo
# root is not on sys.path), so the script is loaded from its file.
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
main = _module.main


@pytest.mark.slow  # a process over the whole tree; `make test` and `make lint` also run it
def test_the_product_code_has_no_cycle_and_no_controlplane_to_workers_import():
    run = subprocess.run([sys.executable, "-m", "scripts.import_graph"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip().endswith("cycles=0 controlplane_to_workers=0")


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_cycle_through_a_function_level_import_exits_1(tmp_path, capsys):
    _write(tmp_path, {
        "controlplane/__init__.py": "",
        "controlplane/alerts.py": "from controlplane import fallback\n",
        # a function-level, relative import is still an arrow
        "controlplane/fallback.py": "def react():\n    from .alerts import fire\n",
        "controlplane/clean.py": "import controlplane.alerts\n",
    })
    assert main(["--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "cycle: controlplane.alerts , controlplane.fallback" in out
    assert "controlplane.clean" not in out.split("modules=")[0]
    assert out.strip().endswith("cycles=1 controlplane_to_workers=0")


def test_an_import_from_controlplane_into_workers_exits_1(tmp_path, capsys):
    _write(tmp_path, {
        "controlplane/__init__.py": "",
        "controlplane/service.py": "from workers.stats.drift import detect\n",
        "workers/__init__.py": "",
        "workers/stats/__init__.py": "",
        "workers/stats/drift.py": "import math\n",
        "workers/tasks.py": "from controlplane.service import *\n",
    })
    assert main(["--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "controlplane imports workers: controlplane.service -> workers.stats.drift" in out
    assert out.strip().endswith("cycles=0 controlplane_to_workers=1")


def test_a_clean_package_exits_0(tmp_path, capsys):
    _write(tmp_path, {"controlplane/__init__.py": "", "controlplane/a.py": "import os\n",
                      "workers/__init__.py": "", "workers/b.py": "from controlplane import a\n"})
    assert main(["--root", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip().endswith("cycles=0 controlplane_to_workers=0")
