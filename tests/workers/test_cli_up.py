"""`exitplane up` on the embedded default runs the API plus a real worker and beat as
subprocesses (beat's drift check raises an alert on its own), and takes them down with it."""

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.alerts.models import Alert
from controlplane.celery_app import make_celery
from controlplane.db import make_engine, utcnow
from controlplane.migrate import upgrade
from controlplane.settings import Settings
from tests.support.alerts import Phase, make_deployment, send_traffic
from tests.support.network import free_port

# slow: `exitplane up` with its worker and beat processes
pytestmark = pytest.mark.slow

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


def _alert_kinds(engine) -> list[str]:
    # A short session each time: an open SQLite transaction would hold off the worker's writes.
    with Session(engine) as session:
        return [alert.kind for alert in session.scalars(select(Alert))]


def test_up_runs_worker_and_beat_and_stops_them(tmp_path):
    port = free_port()
    var_dir = tmp_path / "var"
    # A deployment whose shadow tokens disagree with full depth: beat's drift check must alert.
    db_url = f"sqlite:///{var_dir / 'exitplane.db'}"
    upgrade(db_url)
    engine = make_engine(db_url)
    start = (utcnow() - timedelta(minutes=10)).replace(second=0, microsecond=0)
    with Session(engine) as session:
        deployment = make_deployment(session, activated_at=start, delta=0.02)
        send_traffic(session, deployment, start=start, seed=9, tokens_per_minute=200,
                     phases=[Phase(10, (0.25, 0.4, 0.3), shadow_rate=0.2, mismatch_rate=0.1)])
        session.commit()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXITPLANE_")}
    env |= {"EXITPLANE_VAR_DIR": str(var_dir), "EXITPLANE_LOG_LEVEL": "warning",
            "EXITPLANE_DRIFT_INTERVAL_S": "2"}
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
        assert app.send_task("runtimes.check_stale").get(timeout=120) == {
            "chat": {"fired": [], "refreshed": [], "resolved": []}}
        deadline = time.monotonic() + 90
        while not (kinds := _alert_kinds(engine)):
            assert time.monotonic() < deadline, "beat's drift check raised no alert"
            time.sleep(0.5)
        assert kinds == ["quality_regression"]
        assert list(var_dir.glob("celerybeat-schedule*"))
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)
    engine.dispose()
    assert not [pid for pid in children if _alive(pid)]
