"""A redis-server of the test's own (`private_redis`), for tests that kill it, bring it back, or
need a Redis that no other test writes to."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import redis

from tests.support.network import free_port


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
    """A private Redis, started; killed and removed after the test."""
    server = PrivateRedis()
    server.start()
    yield server
    server.cleanup()
