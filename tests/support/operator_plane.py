"""A control plane started with `exitplane up` on a copy of the migrated SQLite template, with
a first admin token written to the database directly, and the `exitplane` program pointed at
it (in this process through click's runner, or as the installed program)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from click.testing import CliRunner
from sqlalchemy.orm import Session

from controlplane.auth.service import create_token
from controlplane.db import make_engine
from exitplane.cli import main
from tests.support.network import free_port
from tests.support.processes import stop_process
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
EXITPLANE = str(Path(sys.executable).parent / "exitplane")
DEPLOYMENT = {"name": "chat", "model_ref": "tiny-llama", "num_layers": 6, "exit_layers": [2, 4],
              "signal": "maxprob", "delta": 0.1, "epsilon": 0.1}


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without EXITPLANE_* settings (the secret key stays)."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("EXITPLANE_") or key == "EXITPLANE_SECRET_KEY"}
    return env | {"EXITPLANE_LOG_LEVEL": "warning", **extra}


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


class Plane:
    """A running `exitplane up` and the `exitplane` program pointed at it."""

    def __init__(self, *, url: str, db_url: str, token_file: Path, env: dict) -> None:
        self.url = url
        self.db_url = db_url
        self.token_file = token_file
        self.env = env
        self.engine = make_engine(db_url)
        self.http = httpx.Client(base_url=url, timeout=30, headers={
            "Authorization": f"Bearer {token_file.read_text().strip()}"})

    def run(self, *args: str, code: int = 0, process: bool = False, input: str | None = None,
            usage: bool = False, **env: str | None) -> Ran:
        """Run `exitplane ARGS` (in this process, or as the installed program, `input` on its
        stdin) and check its exit status; a failure is one line (after a prompt's own), or
        with `usage` click's usage error."""
        env = {"EXITPLANE_URL": self.url, "EXITPLANE_TOKEN_FILE": str(self.token_file),
               "EXITPLANE_TOKEN": None, "EXITPLANE_OUTPUT": None} | env
        if process:
            done = subprocess.run([EXITPLANE, *args], cwd=ROOT, capture_output=True, text=True,
                                  timeout=120, input=input,
                                  env={key: value for key, value in
                                       (self.env | env).items() if value is not None})
            ran = Ran(done.returncode, done.stdout, done.stderr)
        else:  # an exception other than the exit would propagate here, as a traceback would
            result = CliRunner(env=env).invoke(main, list(args), input=input,
                                               catch_exceptions=False)
            ran = Ran(result.exit_code, result.stdout, result.stderr)
        assert ran.returncode == code, (args, ran)
        assert "Traceback" not in ran.stderr, ran.stderr
        if code and usage:
            assert ran.stderr.startswith("Usage: ") and "Error: " in ran.stderr, ran.stderr
        elif code:
            last = ran.stderr.splitlines()[-1] if input is not None else ran.stderr
            assert last.startswith("exitplane: ") and last.count("\n") <= 1, ran.stderr
        return ran

    def json(self, *args: str):
        return json.loads(self.run(*args, "--output", "json").stdout)

    def session(self) -> Session:
        return Session(self.engine)


@contextmanager
def served_plane(sqlite_template: str, tmp: Path, **settings: str) -> Iterator[Plane]:
    """`exitplane up` on a copy of the template with deployment `chat` (DEPLOYMENT) created
    over the API by the admin token `ops`; `settings`: more EXITPLANE_* variables."""
    db_path = tmp / "exitplane.db"
    shutil.copy(sqlite_template, db_path)
    db_url = f"sqlite:///{db_path}"
    env = clean_env(EXITPLANE_VAR_DIR=str(tmp / "var"), EXITPLANE_DATABASE_URL=db_url,
                    **settings)
    token_file = tmp / "admin.token"
    engine = make_engine(db_url)
    with Session(engine) as session:  # the first admin token, as `exitplane bootstrap token`
        _, secret = create_token(session=session, name="ops", scope="admin")
        session.commit()
    engine.dispose()
    token_file.write_text(secret + "\n")
    port = free_port()
    with (tmp / "up.log").open("w") as log:
        process = subprocess.Popen([EXITPLANE, "up", "--port", str(port), "--no-migrate",
                                    "--no-workers"], cwd=ROOT, env=env, stdout=log,
                                   stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _ready(url) or process.poll() is not None, 90, "exitplane up")
        assert process.poll() is None, (tmp / "up.log").read_text()
        found = Plane(url=url, db_url=db_url, token_file=token_file, env=env)
        assert found.http.post("/v1/deployments", json=DEPLOYMENT).status_code == 201
        yield found
        found.engine.dispose()
    finally:
        stop_process(process)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
