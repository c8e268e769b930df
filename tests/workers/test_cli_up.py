"""`exitplane up` on the embedded default runs the API plus a real worker and beat as
subprocesses, and takes them down with it."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from controlplane.settings import Settings
from tests.conftest import free_port
from workers.celery_app import make_celery

ROOT = Path(__file__).resolve().parents[2]


def _children(pid: int) -> set[int]:
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found |= {int(p) for p in (task / "children").read_text().split()}
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "zombie" not in status.read_text()


def test_up_runs_worker_and_beat_and_stops_them(tmp_path):
    port = free_port()
    var_dir = tmp_path / "var"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXITPLANE_")}
    env |= {"EXITPLANE_VAR_DIR": str(var_dir), "EXITPLANE_LOG_LEVEL": "warning"}
    up = subprocess.Popen([sys.executable, "-m", "exitplane.cli", "up", "--port", str(port)],
                          cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                          stderr=(tmp_path / "up.log").open("w"))
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert up.poll() is None, (tmp_path / "up.log").read_text()
            assert time.monotonic() < deadline, "the API did not come up"
            time.sleep(0.3)
        children = _children(up.pid)
        assert len(children) == 2
        # The worker answers on the embedded SQLite broker; beat keeps its schedule under var/.
        app = make_celery(Settings(var_dir=var_dir))
        assert app.send_task("runtimes.check_stale").get(timeout=120) == {}
        deadline = time.monotonic() + 60
        while not list(var_dir.glob("celerybeat-schedule*")):
            assert time.monotonic() < deadline, "beat did not start"
            time.sleep(0.3)
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)
    assert not [pid for pid in children if _alive(pid)]
