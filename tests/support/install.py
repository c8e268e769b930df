"""Fresh virtual environments for the install-path tests, offline: a venv without pip, driven by
this environment's pip (`pip --python`), with the dependencies it needs copied in from this
environment's installed distributions, so `--no-index` installs resolve without a network."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The client's dependencies with theirs, the server's base dependency (click), and the two build
# backends with theirs (a `--no-build-isolation` build runs in the target environment).
CLIENT_DEPENDENCIES = ["pydantic", "pydantic-core", "annotated-types", "typing-extensions",
                       "typing-inspection", "httpx", "httpcore", "h11", "anyio", "idna",
                       "certifi", "sniffio", "msgpack"]
SERVER_BASE = ["click"]
BUILD_BACKENDS = ["setuptools", "hatchling", "packaging", "pathspec", "pluggy",
                  "trove-classifiers"]
# What a source tree for building both distributions holds (the server's pyproject.toml names
# README.md and LICENSE; the client's LICENSE is a link to the top one).
SOURCE_FILES = ("pyproject.toml", "README.md", "LICENSE")
SOURCE_PACKAGES = ("exitplane", "controlplane", "runtime", "workers", "dashboards", "migrations")
# Added to every pip command a document gives, so it runs offline here; what it installs is
# unchanged.
OFFLINE = ("--no-index", "--no-build-isolation")


def copy_distribution(name: str, site: Path) -> None:
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


def fresh_venv(path: Path, distributions: list[str]) -> Path:
    """A virtual environment at `path` holding `distributions` (copied); its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True,
                   timeout=120)
    python = path / "bin" / "python"
    site = Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip())
    for name in distributions:
        copy_distribution(name, site)
    return python


def source_tree(into: Path) -> Path:
    """A copy of the checkout's installable parts at `into` (links resolved, no build output)."""
    into.mkdir(parents=True, exist_ok=True)
    for name in SOURCE_FILES:
        shutil.copy2(ROOT / name, into / name)
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", ".*cache*")
    for package in SOURCE_PACKAGES:
        shutil.copytree(ROOT / package, into / package, ignore=skip)
    shutil.copytree(ROOT / "clients" / "python", into / "clients" / "python", ignore=skip)
    return into


def read_only(path: Path) -> list[str]:
    """The prefix that runs a command with `path` mounted read-only (a private mount
    namespace), for root, whom file modes do not stop; empty for anyone else, for whom the
    caller's `chmod -R a-w` is enough, and where no mount namespace can be made."""
    if os.geteuid() != 0:
        return []
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "--mount", "true"],
                                         capture_output=True).returncode != 0:
        return []  # no mount namespace here: the caller's before/after listing still checks
    return [unshare, "--mount", "sh", "-c",
            'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"', str(path)]


def pip(python: Path, command: str, *, cwd: Path,
        prefix: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run a documented `pip ...` command for the environment of `python`, offline: this
    environment's pip with `--python`, the command's own arguments unchanged (globs expanded
    in `cwd` as a shell would); `prefix` wraps it (`read_only`)."""
    words = shlex.split(command)
    assert words[0] == "pip", command
    expanded: list[str] = []
    for word in words[1:]:
        matches = sorted(str(path.relative_to(cwd)) for path in cwd.glob(word)) \
            if "*" in word else []
        expanded += matches or [word]
    subcommand, rest = expanded[0], expanded[1:]
    env = {**os.environ, "HOME": str(python.parents[1]), "PIP_NO_CACHE_DIR": "1"}
    return subprocess.run(
        [*(prefix or []), sys.executable, "-m", "pip", "--python", str(python), subcommand, "-q",
         *OFFLINE, *rest], cwd=cwd, capture_output=True, text=True, timeout=600, env=env)
