"""A runtime server is a fleet member that comes and goes cleanly: its id is kept in its state
directory (a restart is the same runtime, not a ghost and a newcomer), and on SIGTERM it
flushes its telemetry and leaves the fleet (no `runtime_stale` alert, no canary member).
Real processes: `exitplane up` on SQLite and `exitplane runtime serve` on the tiny model."""

from __future__ import annotations

import os
import secrets
import subprocess

import httpx
import pytest

from runtime.cli import kept_runtime_id
from tests.support.network import free_port
from tests.support.processes import (
    EXITPLANE,
    answers,
    print_tails,
    provision_chat,
    spawn,
    stop_processes,
)
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_the_kept_id_is_made_once_and_a_bad_one_is_replaced(tmp_path):
    made = kept_runtime_id(tmp_path / "state")
    assert kept_runtime_id(tmp_path / "state") == made
    assert (tmp_path / "state" / "runtime-id").read_text().strip() == made
    (tmp_path / "state" / "runtime-id").write_text("not a valid id!\n")
    replaced = kept_runtime_id(tmp_path / "state")
    assert replaced != made and replaced != "not a valid id!"
    assert kept_runtime_id(tmp_path / "other") != replaced  # each state directory its own


def test_a_stopped_runtime_leaves_and_a_restarted_one_keeps_its_id(tmp_path):
    ports = {"api": free_port(), "runtime": free_port()}
    api = f"http://127.0.0.1:{ports['api']}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXITPLANE_")}
    env.update({"EXITPLANE_DATABASE_URL": f"sqlite:///{tmp_path / 'exitplane.db'}",
                "EXITPLANE_SECRET_KEY": secrets.token_urlsafe(48),
                "EXITPLANE_VAR_DIR": str(tmp_path / "var"), "EXITPLANE_LOG_LEVEL": "warning"})
    subprocess.run([EXITPLANE, "db", "upgrade"], env=env, check=True, capture_output=True,
                   timeout=120)
    token_file, admin = provision_chat(env, tmp_path)
    serve = [EXITPLANE, "runtime", "serve", "--model", "tiny", "--deployment", "chat",
             "--control-plane", api, "--token-file", str(token_file), "--state-dir",
             str(tmp_path / "runtime"), "--port", str(ports["runtime"])]
    logs = [tmp_path / "api.log", tmp_path / "runtime.log"]
    processes = [spawn([EXITPLANE, "up", "--port", str(ports["api"]), "--no-migrate",
                        "--no-workers"], out=logs[0], env=env)]
    ops = httpx.Client(base_url=api, headers={"Authorization": f"Bearer {admin}"}, timeout=30)

    def fleet() -> list[str]:
        return [row["runtime_id"] for row in ops.get("/v1/deployments/chat/runtimes").json()]

    try:
        wait_until(lambda: answers(f"{api}/readyz"), 120, "the API")
        runtime = spawn(serve, out=logs[1], env=env)
        processes.append(runtime)
        wait_until(lambda: answers(f"http://127.0.0.1:{ports['runtime']}/readyz"), 120,
                   "the runtime serving")
        wait_until(lambda: len(fleet()) == 1, 120, "the runtime's first heartbeat")
        first = fleet()[0]
        assert first == (tmp_path / "runtime" / "runtime-id").read_text().strip()

        runtime.terminate()
        # uvicorn shuts down gracefully, then re-raises the signal it caught.
        assert runtime.wait(60) in (0, -15)
        assert fleet() == []  # it left: nothing stale stays behind

        again = spawn(serve, out=logs[1], env=env)
        processes.append(again)
        wait_until(lambda: len(fleet()) == 1, 120, "the restarted runtime's heartbeat")
        assert fleet() == [first]
    except BaseException:
        print_tails(logs, 3000)
        raise
    finally:
        stop_processes(processes)
