"""A PostgreSQL cluster of the test's own (`private_postgres`), for tests that stop and start
it."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.support.network import free_port


def _bin() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"))
    if not found:
        raise RuntimeError("PostgreSQL server binaries are missing: run scripts/services.sh start")
    return Path(found[-1]).parent


class PrivatePostgres:
    def __init__(self) -> None:
        self.bin = _bin()
        self.dir = Path(tempfile.mkdtemp(prefix="exitplane-pg-"))
        self.data = self.dir / "data"
        self.port = free_port()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres")
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")

    def _run(self, tool: str, *args: str) -> None:
        command = [str(self.bin / tool), *args]
        if os.geteuid() == 0:  # PostgreSQL refuses to run as root
            command = ["su", "postgres", "-s", "/bin/sh", "-c", " ".join(
                f"'{part}'" for part in command)]
        subprocess.run(command, check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "log"), "-w", "-t", "60",
                  "-o", f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 "
                        "-c fsync=off", "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def cleanup(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def private_postgres():
    """A private PostgreSQL cluster, started; removed after the test."""
    server = PrivatePostgres()
    server.start()
    yield server
    server.cleanup()
