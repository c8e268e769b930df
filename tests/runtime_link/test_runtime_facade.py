"""`exitplane.client.Runtime` and `AsyncRuntime`: offline from a file (re-read on change),
listeners, a token file rotated under a running runtime (which then leaves with the new
token), leaving the fleet (never with another deployment's token; no `runtime_stale` after
it), and the asyncio variant, against a real control plane."""

from __future__ import annotations

import asyncio
import os
import time
from datetime import timedelta

import httpx
import pytest
from sqlalchemy.orm import Session

from controlplane.auth.service import create_token, revoke_token
from controlplane.db import utcnow
from controlplane.deployments.service import get_deployment
from controlplane.drift.service import check_runtimes
from exitplane.client import AsyncRuntime, RefusedThresholdSet, Runtime
from exitplane.wire import ThresholdSetWire
from tests.support.runtime_link import DEPLOYMENT, EXIT_LAYERS, NUM_LAYERS, publish
from tests.support.waiting import wait_until

FAST = {"long_poll_s": 0.5, "heartbeat_interval_s": 0.5, "backoff_initial_s": 0.05,
        "backoff_max_s": 0.3}


def _write_set(path, version: int, thresholds: dict[int, float]) -> None:
    wire = ThresholdSetWire.build(deployment=DEPLOYMENT, version=version, signal="maxprob",
                                  thresholds=thresholds)
    path.write_text(wire.model_dump_json())
    stat = path.stat()  # mtime a second on: a coarse file system still sees the change
    os.utime(path, (stat.st_atime, stat.st_mtime + version))


def test_offline_mode_applies_the_file_and_rereads_it(tmp_path):
    path = tmp_path / "set.json"
    _write_set(path, 3, {2: 0.9, 4: 0.8})
    changes, refused = [], []
    with Runtime(deployment=DEPLOYMENT, runtime_id="offline-1", num_layers=NUM_LAYERS,
                 exit_layers=EXIT_LAYERS, offline_file=path, file_check_s=0.05) as rt:
        rt.on_change(changes.append)
        rt.on_refused(refused.append)
        assert rt.version == 3 and rt.exit_layer({2: 0.95, 4: 0.1}, rt.thresholds_for()) \
            == (2, 0.95)
        assert rt.exit_layer({2: 0.5, 4: 0.5}, rt.thresholds_for()) == (NUM_LAYERS, 0.5)
        assert rt.record(request_id="r", position=0, exit_layer=2, signal_value=0.95) is False
        _write_set(path, 4, {2: 0.5, 4: 0.5})
        wait_until(lambda: rt.version == 4, message="the new file is applied")
        _write_set(path, 5, {2: 0.5, 7: 0.5})  # other exit layers: refused, v4 stays
        wait_until(lambda: refused, message="the bad file is refused")
        assert rt.version == 4 and "exit layers" in refused[0]
        assert rt.metrics["dropped_offline"] == 1
    assert [c.version for c in changes] == [3, 4]


def test_offline_mode_refuses_a_bad_file_at_start(tmp_path):
    path = tmp_path / "set.json"
    _write_set(path, 3, {2: 0.9, 5: 0.8})
    with pytest.raises(RefusedThresholdSet, match="exit layers"):
        Runtime(deployment=DEPLOYMENT, runtime_id="offline-1", num_layers=NUM_LAYERS,
                exit_layers=EXIT_LAYERS, offline_file=path).start()


def test_from_env_reads_the_variables_and_says_what_is_missing(monkeypatch, tmp_path):
    path = tmp_path / "set.json"
    _write_set(path, 1, {2: 1.0, 4: 1.0})
    for name, value in {"EXITPLANE_DEPLOYMENT": DEPLOYMENT, "EXITPLANE_RUNTIME_ID": "env-1",
                        "EXITPLANE_EXIT_LAYERS": "2, 4", "EXITPLANE_SHADOW_RATE": "0.25",
                        "EXITPLANE_THRESHOLDS_FILE": str(path)}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="EXITPLANE_NUM_LAYERS"):
        Runtime.from_env()
    rt = Runtime.from_env(num_layers=NUM_LAYERS)
    assert (rt.runtime_id, rt.exit_layers, rt.shadow_rate) == ("env-1", [2, 4], 0.25)
    monkeypatch.setenv("EXITPLANE_SHADOW_RATE", "a lot")
    with pytest.raises(ValueError, match="EXITPLANE_SHADOW_RATE"):
        Runtime.from_env(num_layers=NUM_LAYERS)


def _runtime_token(engine, name: str) -> tuple[int, str]:
    with Session(engine) as session:
        token, secret = create_token(session=session, name=name, scope="runtime",
                                     deployment=get_deployment(session=session, name=DEPLOYMENT))
        session.commit()
        return token.id, secret


@pytest.mark.slow  # a control plane, seconds of polling
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_rotated_token_file_is_used_without_a_restart(control_plane, operator, engine,
                                                       tmp_path):
    old_id, old = _runtime_token(engine, "rt-old")
    token_file = tmp_path / "token"
    token_file.write_text(old + "\n")
    publish(operator, {2: 0.9, 4: 0.9})
    with Runtime(url=control_plane.url, token_file=token_file, deployment=DEPLOYMENT,
                 runtime_id="rotating-1", num_layers=NUM_LAYERS, exit_layers=EXIT_LAYERS,
                 state_dir=tmp_path / "state", file_check_s=0.05,
                 threshold_options=FAST) as rt:
        _, new = _runtime_token(engine, "rt-new")
        token_file.write_text(new + "\n")
        wait_until(lambda: rt._token == new, message="the new token is read")
        with Session(engine) as session:
            revoke_token(session=session, token_id=old_id)
            session.commit()
        beats = rt.metrics["thresholds_heartbeats"]
        wait_until(lambda: rt.metrics["thresholds_heartbeats"] > beats + 1,
                   message="heartbeats go on with the new token")
        version = publish(operator, {2: 0.8, 4: 0.8})
        wait_until(lambda: rt.version == version, message="pulls go on with the new token")
        assert rt.heartbeat()
        errors = []
        rt.on_error(errors.append)
    # The old (now revoked) token registered the runtime: it leaves with the one it holds now.
    assert operator.get(f"/v1/deployments/{DEPLOYMENT}/runtimes").json() == []
    assert errors == []


@pytest.mark.slow  # a control plane
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_close_reads_the_token_file_once_more_before_it_leaves(control_plane, operator,
                                                              engine, tmp_path):
    old_id, old = _runtime_token(engine, "rt-old")
    token_file = tmp_path / "token"
    token_file.write_text(old + "\n")
    publish(operator, {2: 0.9, 4: 0.9})
    errors = []
    rt = Runtime(url=control_plane.url, token_file=token_file, deployment=DEPLOYMENT,
                 runtime_id="rotated-late", num_layers=NUM_LAYERS, exit_layers=EXIT_LAYERS,
                 state_dir=tmp_path / "state", file_check_s=3600, threshold_options=FAST)
    rt.on_error(errors.append)
    rt.start()
    fleet = f"/v1/deployments/{DEPLOYMENT}/runtimes"
    wait_until(lambda: operator.get(fleet).json(), message="the runtime is listed")
    # rotated just before the stop, too late for the file watcher (it looks once an hour)
    _, new = _runtime_token(engine, "rt-new")
    token_file.write_text(new + "\n")
    with Session(engine) as session:
        revoke_token(session=session, token_id=old_id)
        session.commit()
    rt.close()
    assert operator.get(fleet).json() == [] and errors == []


@pytest.mark.slow  # a control plane
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_leaving_takes_the_runtime_out_and_no_other_deployments_token_may(
        control_plane, operator, engine, tmp_path):
    _, mine = _runtime_token(engine, "rt-mine")
    assert operator.post("/v1/deployments", json={
        "name": "elsewhere", "model_ref": "m", "num_layers": NUM_LAYERS,
        "exit_layers": EXIT_LAYERS}).status_code == 201
    with Session(engine) as session:
        _, other = create_token(session=session, name="rt-elsewhere", scope="runtime",
                                deployment=get_deployment(session=session, name="elsewhere"))
        session.commit()
    publish(operator, {2: 0.9, 4: 0.9})
    errors = []
    rt = Runtime(url=control_plane.url, token=mine, deployment=DEPLOYMENT,
                 runtime_id="leaving-1", num_layers=NUM_LAYERS, exit_layers=EXIT_LAYERS,
                 state_dir=tmp_path / "state", threshold_options=FAST)
    rt.on_error(errors.append)
    rt.start()
    fleet = f"/v1/deployments/{DEPLOYMENT}/runtimes"
    wait_until(lambda: [r["runtime_id"] for r in operator.get(fleet).json()] == ["leaving-1"],
               message="the runtime is listed")
    leave = f"{control_plane.url}{fleet}/leaving-1/leave"
    refused = httpx.post(leave, headers={"Authorization": f"Bearer {other}"})
    assert refused.status_code == 403 and "another deployment" in refused.text
    assert [r["runtime_id"] for r in operator.get(fleet).json()] == ["leaving-1"]
    rt.close()
    assert operator.get(fleet).json() == [] and errors == []
    again = httpx.post(leave, headers={"Authorization": f"Bearer {mine}"})
    assert again.status_code == 404  # already gone


@pytest.mark.slow  # a control plane
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_runtime_that_left_never_goes_stale(control_plane, operator, runtime_token, engine,
                                             settings, tmp_path):
    """Two runtimes stop; the one whose close() leaves is out of the fleet view and of the
    stale check run past the stale window, the one that stops without leaving is paged."""
    publish(operator, {2: 0.9, 4: 0.9})
    fleet = f"/v1/deployments/{DEPLOYMENT}/runtimes"
    runtimes = {name: Runtime(url=control_plane.url, token=runtime_token, deployment=DEPLOYMENT,
                              runtime_id=name, num_layers=NUM_LAYERS, exit_layers=EXIT_LAYERS,
                              state_dir=tmp_path / name, threshold_options=FAST).start()
                for name in ("leaving-1", "crashing-1")}
    wait_until(lambda: len(operator.get(fleet).json()) == 2, message="both runtimes listed")
    runtimes["leaving-1"].close()
    runtimes["crashing-1"].close(leave=False)
    assert [r["runtime_id"] for r in operator.get(fleet).json()] == ["crashing-1"]

    later = utcnow() + timedelta(seconds=settings.runtime_stale_after_s + 60)
    with Session(engine) as session:
        result = check_runtimes(session=session, deployment=get_deployment(
            session=session, name=DEPLOYMENT), stale_after_s=settings.runtime_stale_after_s,
            clear_after_s=settings.alert_clear_after_s, now=later)
        session.commit()
        [alert] = result.fired
        assert alert.kind == "runtime_stale"
        assert [r["runtime_id"] for r in alert.evidence["runtimes"]] == ["crashing-1"]
        assert "leaving-1" not in alert.summary


@pytest.mark.slow  # a control plane
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_asyncio_variant(control_plane, operator, runtime_token, tmp_path):
    first = publish(operator, {2: 0.9, 4: 0.9})

    async def serve() -> list[tuple[int, bool]]:
        seen: list[tuple[int, bool]] = []
        loop = asyncio.get_running_loop()

        async with AsyncRuntime(url=control_plane.url, token=runtime_token,
                                deployment=DEPLOYMENT, runtime_id="async-1",
                                num_layers=NUM_LAYERS, exit_layers=EXIT_LAYERS,
                                state_dir=tmp_path / "state", threshold_options=FAST) as rt:
            @rt.on_change
            async def changed(threshold_set):
                seen.append((threshold_set.version, asyncio.get_running_loop() is loop))

            second = await asyncio.to_thread(publish, operator, {2: 0.7, 4: 0.7})
            deadline = time.monotonic() + 20
            while rt.version != second and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert rt.record(request_id="a", position=0, exit_layer=2, signal_value=0.95)
            assert await rt.flush(10)
            await asyncio.sleep(0.1)  # the listener runs on the loop
        return seen

    seen = asyncio.run(serve())
    assert seen == [(first, True), (first + 1, True)]
    assert operator.get(f"/v1/deployments/{DEPLOYMENT}/runtimes").json() == []
