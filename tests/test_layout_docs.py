"""The layout as documented matches the tree: CONTRIBUTING's table names every top-level folder
git tracks and only those, and docs/architecture.md lists the control plane's layers in the
order `.importlinter` enforces them, naming modules that exist."""

from __future__ import annotations

import configparser
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tracked_folders() -> set[str]:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    return {name.split("/")[0] for name in files if "/" in name and not name.startswith(".")}


def _layers() -> list[str]:
    config = configparser.ConfigParser()
    config.read(ROOT / ".importlinter")
    section = next(name for name in config.sections()
                   if config[name].get("containers", "").strip() == "controlplane")
    return [line.strip() for line in config[section]["layers"].splitlines() if line.strip()]


def test_contributing_names_every_top_level_folder_and_no_other():
    text = (ROOT / "CONTRIBUTING.md").read_text()
    table = text[text.index("## Layout"):text.index("## Conventions")]
    documented = set(re.findall(r"^\| `([\w.-]+)/` \|", table, flags=re.MULTILINE))
    assert documented == _tracked_folders()


def test_the_architecture_page_lists_the_enforced_layers_in_order():
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \|", text, flags=re.MULTILINE)
    assert rows == _layers()
    for layer in rows:
        assert (ROOT / "controlplane" / layer / "__init__.py").is_file(), layer


def test_the_modules_the_architecture_page_names_exist():
    # task names in quotes ("calibration.run") are Celery's names, not modules
    text = re.sub(r'"[^"\n]*"', "", (ROOT / "docs" / "architecture.md").read_text())
    packages = ("controlplane", "workers", "runtime", "dashboards", "exitplane")
    names = set(re.findall(r"\b((?:edge|guards|flows|calibration|drift|telemetry|runtimes|alerts"
                           r"|deployments|auth|coordination|stats)(?:\.\w+)+)", text))
    names |= {name for name in re.findall(r"\b((?:exitplane|workers)(?:\.\w+)+)", text)}
    assert names, "the page names no module"
    for name in sorted(names):
        parts = name.split(".")
        if parts[0] not in packages:
            parts = ["controlplane", *parts]
        # the longest prefix that is a module or package; the rest are names inside it
        for cut in range(len(parts), 0, -1):
            base = ROOT.joinpath(*parts[:cut])
            if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
                break
            if parts[0] == "exitplane" and cut >= 2 and parts[1] in ("client", "wire"):
                base = ROOT / "clients" / "python" / "src" / Path(*parts[:cut])
                if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
                    break
        else:
            raise AssertionError(f"docs/architecture.md names {name}, which does not exist")
        if cut < len(parts):  # a name inside the module: defined there
            source = base.with_suffix(".py") if base.with_suffix(".py").is_file() \
                else base / "__init__.py"
            inside = parts[cut]
            assert re.search(rf"^\s*(def|class|async def) {inside}\b|^{inside}\b\s*[:=]",
                             source.read_text(), flags=re.MULTILINE), name
