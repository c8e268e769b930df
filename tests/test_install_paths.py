"""The install paths the README and the getting-started page give work as written: from a
checkout (the client first, then the server in compat editable mode), from wheels built of both
distributions, and as the Dockerfile installs them; the client builds out of tree, from a
read-only copy. Each runs in a fresh virtual environment, offline: the commands get
`--no-index --no-build-isolation` and the environment holds copies of the dependencies and build
backends they need. The extras' own dependencies are PyPI's and are left out (`.[all]` installs
as `.`): what is under test is that the unpublished exitplane-client satisfies the server's pin
and that both halves of the `exitplane` namespace import."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from tests.support.install import (
    BUILD_BACKENDS,
    CLIENT_DEPENDENCIES,
    ROOT,
    SERVER_BASE,
    fresh_venv,
    pip,
    read_only,
    source_tree,
)

CHECKOUT = ["pip install ./clients/python",
            "pip install -e '.[all]' --config-settings editable_mode=compat"]
WHEELS = ["pip wheel --no-deps --wheel-dir dist ./clients/python .",
          "pip install dist/*.whl"]
DOCUMENTS = [ROOT / "README.md", ROOT / "docs" / "getting-started" / "index.md"]
PROBE = ("import exitplane, exitplane.cli, exitplane.client, exitplane.wire; "
         "print(exitplane.__version__, exitplane.wire.__name__, exitplane.client.__name__)")


def _shell_lines(text: str) -> list[str]:
    """The commands of a document's shell blocks, one per line, comments dropped."""
    lines = []
    for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = line.split(" #")[0].strip()
            if command:
                lines.append(" ".join(command.split()))
    return lines


def _works(python: Path) -> list[str]:
    """What the probe prints in the environment of `python`, run away from any source tree."""
    env = {"PATH": f"{python.parent}:{os.environ['PATH']}"}
    out = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, cwd="/",
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    cli = subprocess.run([str(python.parent / "exitplane"), "--version"], capture_output=True,
                         text=True, cwd="/", env=env, timeout=120)
    assert cli.returncode == 0 and "0.1.0" in cli.stdout, cli.stderr
    return out.stdout.split()


def _ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_the_documents_give_the_install_paths_that_work(document):
    lines = _shell_lines(document.read_text())
    for path in (CHECKOUT, WHEELS):
        found = [lines.index(command) for command in path if command in lines]
        assert len(found) == len(path) and found == sorted(found), (document.name, path)
    # exitplane is not on PyPI: no command installs it (or the client) by name from an index
    by_name = [line for line in lines if re.search(r"pip install .*'?exitplane(-client)?\[", line)
               and "dist/" not in line]
    assert by_name == []
    # the server from a checkout without the client first fails to resolve exitplane-client
    assert "pip install -e '.[all]'" not in lines


@pytest.mark.slow  # two editable installs into a fresh environment
def test_from_a_checkout(tmp_path):
    tree = source_tree(tmp_path / "checkout")
    python = fresh_venv(tmp_path / "venv", CLIENT_DEPENDENCIES + SERVER_BASE + BUILD_BACKENDS)
    for command in CHECKOUT:
        _ok(pip(python, command.replace("'.[all]'", "."), cwd=tree))
    assert _works(python) == ["0.1.0", "exitplane.wire", "exitplane.client"]
    # the server's part is live from the checkout (editable), the client's is installed
    (tree / "exitplane" / "__init__.py").write_text(
        (tree / "exitplane" / "__init__.py").read_text() + "\nCHECKOUT_MARK = 1\n")
    out = subprocess.run([str(python), "-c", "import exitplane, exitplane.wire; "
                          "print(exitplane.CHECKOUT_MARK, exitplane.wire.__file__)"],
                         capture_output=True, text=True, cwd="/", timeout=60)
    mark, wire = out.stdout.split()
    assert mark == "1" and wire.startswith(str(tmp_path / "venv")), out.stderr


@pytest.mark.slow  # builds two wheels and installs them
def test_from_wheels(tmp_path):
    tree = source_tree(tmp_path / "checkout")
    builder = fresh_venv(tmp_path / "builder", BUILD_BACKENDS)
    _ok(pip(builder, WHEELS[0], cwd=tree))
    wheels = sorted(path.name for path in (tree / "dist").glob("*.whl"))
    assert wheels == ["exitplane-0.1.0-py3-none-any.whl",
                      "exitplane_client-0.1.0-py3-none-any.whl"]
    assert not list((tree / "clients" / "python").rglob("*.egg-info"))
    assert not (tree / "clients" / "python" / "build").exists()
    # no build backend in the target: wheels install as they are
    python = fresh_venv(tmp_path / "venv", CLIENT_DEPENDENCIES + SERVER_BASE)
    _ok(pip(python, WHEELS[1], cwd=tree))
    assert _works(python) == ["0.1.0", "exitplane.wire", "exitplane.client"]


def test_the_client_installs_from_a_read_only_copy(tmp_path):
    """`chmod -R a-w`, and for root (whom modes do not stop) a read-only mount as well."""
    source = tmp_path / "client"
    # copytree resolves the LICENSE link into a file of the copy
    shutil.copytree(ROOT / "clients" / "python", source,
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build",
                                                  ".*cache*"))
    python = fresh_venv(tmp_path / "venv", CLIENT_DEPENDENCIES + BUILD_BACKENDS)
    before = sorted(path.relative_to(source).as_posix() for path in source.rglob("*"))
    paths = [source, *source.rglob("*")]
    for path in paths:
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        _ok(pip(python, f"pip install {shlex.quote(str(source))}", cwd=tmp_path,
                prefix=read_only(source)))
    finally:
        for path in paths:
            path.chmod(path.stat().st_mode | stat.S_IWUSR)
    assert sorted(path.relative_to(source).as_posix() for path in source.rglob("*")) == before
    out = subprocess.run([str(python), "-c", "import exitplane.client, exitplane.wire; "
                          "print(exitplane.wire.__file__)"], capture_output=True, text=True,
                         cwd="/", timeout=60)
    assert out.returncode == 0 and out.stdout.startswith(str(tmp_path / "venv")), out.stderr


def _dockerfile_stages() -> dict[str, list[str]]:
    """Each stage of the Dockerfile: its instructions, continuation lines joined."""
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("FROM "):
            current = stages.setdefault(line.split()[-1], [])
        current.append(line)
    return stages


@pytest.mark.slow  # builds and installs both distributions as the image does
@pytest.mark.parametrize("stage", ["controlplane", "runtime"])
def test_the_image_installs_from_what_it_copies(tmp_path, stage):
    """The files the base stage copies into /app are enough for the stage's pip install."""
    stages = _dockerfile_stages()
    app = tmp_path / "app"
    app.mkdir()
    for line in stages["base"]:
        if line.startswith("COPY "):
            *sources, target = shlex.split(line)[1:]
            for name in sources:
                into = app / target if target not in ("./", ".") else app / name
                if (ROOT / name).is_dir():  # links stay links, as COPY keeps them
                    shutil.copytree(ROOT / name, into, symlinks=True,
                                    ignore=shutil.ignore_patterns(
                                        "__pycache__", "*.egg-info", "build", ".*cache*"))
                else:
                    into.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(ROOT / name, into)
    [install] = [line for line in stages[stage] if line.startswith("RUN pip install ")]
    first = install.removeprefix("RUN ").split(" && ")[0]
    assert first.startswith("pip install ./clients/python '.["), first
    python = fresh_venv(tmp_path / "venv", CLIENT_DEPENDENCIES + SERVER_BASE + BUILD_BACKENDS)
    _ok(pip(python, re.sub(r"'\.\[\w+\]'", ".", first), cwd=app))
    assert _works(python) == ["0.1.0", "exitplane.wire", "exitplane.client"]
    # both distributions carry the license their metadata names
    licensed = subprocess.run(
        [str(python), "-c", "from importlib import metadata; print(sorted(name for name in "
         "('exitplane', 'exitplane-client') if any(file.name == 'LICENSE' for file in "
         "metadata.files(name))))"], capture_output=True, text=True, cwd="/", timeout=60)
    assert licensed.stdout.split() == ["['exitplane',", "'exitplane-client']"], licensed.stderr
