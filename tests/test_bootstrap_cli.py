"""The bootstrap commands (database access): `exitplane bootstrap deployment` creates the
deployment once and is a no-op when re-run with the same settings (a clear refusal when they
differ), and `exitplane bootstrap token --out FILE --if-missing` writes the runtime's token
once. The deprecated spellings (`deployment ensure`, `token create`, `user create`, `segment
...`, `calibrate`) still run, after one line on stderr that names what replaces them, and are
left out of the help."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from controlplane.db import make_engine
from controlplane.deployments.models import Deployment

EXITPLANE = str(Path(sys.executable).parent / "exitplane")
ENSURE = ["bootstrap", "deployment", "--name", "chat", "--model-ref", "tiny-llama",
          "--num-layers", "6", "--exit-layers", "2,4", "--signal", "maxprob", "--delta", "0.2"]


@pytest.fixture
def env(tmp_path, sqlite_template):
    path = tmp_path / "exitplane.db"
    shutil.copy(sqlite_template, path)
    return {**os.environ, "EXITPLANE_DATABASE_URL": f"sqlite:///{path}",
            "EXITPLANE_VAR_DIR": str(tmp_path / "var")}


def _run(env, *args):
    return subprocess.run([EXITPLANE, *args], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow  # runs the CLI's process
def test_deployment_ensure_creates_once_then_is_a_noop(env):
    first = _run(env, *ENSURE)
    assert first.returncode == 0, first.stderr
    assert "created" in first.stderr
    again = _run(env, *ENSURE)
    assert again.returncode == 0 and "nothing to do" in again.stderr
    engine = make_engine(env["EXITPLANE_DATABASE_URL"])
    with engine.connect() as connection:
        rows = connection.execute(select(Deployment.name, Deployment.exit_layers,
                                         Deployment.delta)).all()
    engine.dispose()
    assert [tuple(r) for r in rows] == [("chat", [2, 4], 0.2)]
    other = _run(env, *ENSURE[:-1], "0.05")
    assert other.returncode == 2
    assert other.stderr.count("\n") == 1 and "different settings" in other.stderr
    assert "'delta': 0.2" in other.stderr
    bad = _run(env, *ENSURE[:7], "1", *ENSURE[8:])  # --num-layers 1
    assert bad.returncode == 2 and "invalid deployment settings" in bad.stderr


@pytest.mark.slow  # runs the CLI's process
def test_token_out_if_missing_writes_once(env, tmp_path):
    assert _run(env, *ENSURE).returncode == 0
    token_file = tmp_path / "bootstrap" / "runtime.token"
    args = ["bootstrap", "token", "--name", "runtime", "--scope", "runtime", "--deployment",
            "chat", "--out", str(token_file), "--if-missing"]
    first = _run(env, *args)
    assert first.returncode == 0, first.stderr
    secret = token_file.read_text().strip()
    assert secret and secret not in first.stdout + first.stderr  # never printed
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    again = _run(env, *args)
    assert again.returncode == 0 and "kept" in again.stderr
    assert token_file.read_text().strip() == secret
    lonely = _run(env, *args[:-3], "--if-missing")
    assert lonely.returncode == 2 and "--if-missing needs --out" in lonely.stderr


@pytest.mark.slow  # runs the CLI's process
def test_the_deprecated_spellings_say_so_then_run(env, tmp_path):
    old = _run(env, "deployment", "ensure", *ENSURE[2:])
    assert old.returncode == 0, old.stderr
    notice, *rest = old.stderr.splitlines()
    assert notice == ("exitplane: `exitplane deployment` is deprecated; use `exitplane "
                      "bootstrap deployment` (database access) or `exitplane deployments` "
                      "(over the API)")
    assert rest == ["deployment 'chat' created"]
    made = _run(env, "token", "create", "--name", "ops", "--scope", "admin")
    assert made.returncode == 0 and made.stdout.startswith("ept_")
    assert made.stderr.startswith("exitplane: `exitplane token` is deprecated; use "
                                  "`exitplane bootstrap token`")
    password = tmp_path / "password"
    password.write_text("correct horse battery staple")
    user = _run(env, "user", "create", "--username", "ana", "--role", "viewer",
                "--password-file", str(password))
    assert user.returncode == 0 and user.stdout == "user 'ana' created with role viewer\n"
    assert "`exitplane users` (over the API)" in user.stderr
    declared = _run(env, "segment", "declare", "--deployment", "chat", "code")
    assert declared.returncode == 0
    assert declared.stderr.splitlines() == [
        "exitplane: `exitplane segment` is deprecated; use `exitplane segments` (over the API)",
        "segment 'code' of 'chat' is in use"]
    calibrate = _run(env, "calibrate", "--deployment", "nope")
    assert calibrate.returncode == 2
    assert calibrate.stderr.splitlines() == [
        "exitplane: `exitplane calibrate` is deprecated; use `exitplane calibrations start "
        "DEPLOYMENT --wait` (over the API)", "exitplane: deployment 'nope' does not exist"]
    shown = _run(env, "--help").stdout
    commands = {line.split()[0] for line in shown.split("Commands:")[1].splitlines()
                if line.strip()}
    assert {"bootstrap", "deployments", "tokens", "segments", "calibrations", "users",
            "hooks"} <= commands
    assert not commands & {"deployment", "token", "segment", "user", "calibrate"}


def test_an_unmigrated_store_says_to_migrate(env, tmp_path):
    empty = {**env, "EXITPLANE_DATABASE_URL": f"sqlite:///{tmp_path / 'empty.db'}"}
    done = _run(empty, *ENSURE)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "is not migrated (no such table: " in done.stderr
    assert "run `exitplane db upgrade` first" in done.stderr
