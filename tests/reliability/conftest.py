"""Private servers for tests that stop and start them: a PostgreSQL cluster, a Redis."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import redis

from tests.conftest import free_port


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
    server = PrivatePostgres()
    server.start()
    yield server
    server.cleanup()


class PrivateRedis:
    """A redis-server of the test's own, configured as docker-compose.yml runs it (append-only
    file on), so that it can be killed and brought back with its data."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="exitplane-redis-"))
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is missing: run scripts/services.sh start")
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--appendonly", "yes", "--save", "", "--protected-mode", "no"],
            stdout=(self.dir / "log").open("a"), stderr=subprocess.STDOUT)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except redis.BusyLoadingError:
                pass
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.05)
        client.close()

    def kill(self) -> None:
        """SIGKILL: a crash, not a shutdown (nothing gets a chance to save)."""
        if self.process is not None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)
            self.process = None

    def cleanup(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def private_redis():
    server = PrivateRedis()
    server.start()
    yield server
    server.cleanup()
