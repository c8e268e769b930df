"""A client generated from the committed OpenAPI document (docs/openapi.json) with
openapi-python-client and the committed generator configuration, used the way a team without our
code would use it against a live `exitplane up`: bearer auth on every call, an operator creating
and listing deployments and publishing a version, a runtime pulling its set (then 304 by ETag),
beating, shipping a batch and leaving, and the documented errors (401, 403, 404, 422) read into
the `Error` model with JSON error locations."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from controlplane.auth.service import create_token
from controlplane.db import make_engine
from controlplane.migrate import upgrade
from tests.support.network import free_port
from tests.support.processes import answers
from tests.support.waiting import wait_until

# slow: generates a client, starts `exitplane up`
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CONFIG = ROOT / "clients" / "openapi" / "openapi-python-client.yml"
PACKAGE = "exitplane_api_client"  # package_name_override in CONFIG


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """The generated package, imported from a fresh generation."""
    out = tmp_path_factory.mktemp("generated") / "client"
    result = subprocess.run(
        [str(BIN / "openapi-python-client"), "generate", "--path",
         str(ROOT / "docs" / "openapi.json"), "--config", str(CONFIG), "--output-path", str(out)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"})
    said = result.stdout + result.stderr
    assert result.returncode == 0, said
    # The generator warns about every part of the document it cannot generate: none may be left.
    assert "warning" not in said.lower(), said
    sys.path.insert(0, str(out))
    try:
        yield importlib.import_module(PACKAGE)
    finally:
        sys.path.remove(str(out))
        for name in [name for name in sys.modules if name.split(".")[0] == PACKAGE]:
            del sys.modules[name]


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory):
    """`exitplane up` (API only) on a fresh embedded store; (base url, an admin token)."""
    var_dir = tmp_path_factory.mktemp("var")
    db_url = f"sqlite:///{var_dir / 'exitplane.db'}"
    upgrade(db_url)
    engine = make_engine(db_url)
    with Session(engine) as session:
        _, admin = create_token(session=session, name="generated-client", scope="admin")
        session.commit()
    engine.dispose()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXITPLANE_")}
    env |= {"EXITPLANE_VAR_DIR": str(var_dir), "EXITPLANE_LOG_LEVEL": "warning"}
    log = var_dir / "up.log"
    up = subprocess.Popen([sys.executable, "-m", "exitplane.cli", "up", "--port", str(port),
                           "--no-migrate", "--no-workers"], cwd=ROOT, env=env,
                          stdout=subprocess.DEVNULL, stderr=log.open("w"))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: answers(f"{base}/readyz") or up.poll() is not None, 90,
                   "exitplane up to get ready", interval=0.3)
        assert up.poll() is None, log.read_text()
        yield base, admin
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)


def _call(module, **kwargs):
    """One generated operation's `sync_detailed`: (status, parsed body, headers)."""
    response = module.sync_detailed(**kwargs)
    return int(response.status_code), response.parsed, response.headers


def test_a_generated_client_drives_a_live_control_plane(api, control_plane):
    base, admin_token = control_plane
    ops = {name: importlib.import_module(f"{PACKAGE}.api.{name}") for name in (
        "deployments.create_deployment", "deployments.list_deployments",
        "deployments.show_deployment", "deployments.publish_threshold_set",
        "deployments.pull_thresholds", "auth.create_token", "runtimes.heartbeat",
        "runtimes.list_runtimes", "runtimes.leave", "telemetry.ingest_telemetry",
        "telemetry.telemetry_count")}
    models = api.models
    admin = api.AuthenticatedClient(base_url=base, token=admin_token,
                                    raise_on_unexpected_status=True)

    # An operator's calls: create, list, publish and activate a version.
    status, created, _ = _call(ops["deployments.create_deployment"], client=admin,
                               body=models.DeploymentCreate(name="chat", model_ref="m",
                                                            num_layers=12, exit_layers=[3, 6, 9]))
    assert status == 201 and isinstance(created, models.DeploymentRead)
    assert created.exit_layers == [3, 6, 9] and created.policy == models.DeploymentReadPolicy.AUTO
    status, listed, _ = _call(ops["deployments.list_deployments"], client=admin)
    assert status == 200 and [d.name for d in listed] == ["chat"]
    thresholds = models.ThresholdSetCreateThresholds.from_dict({"3": 0.9, "6": 0.8, "9": 0.7})
    status, published, _ = _call(ops["deployments.publish_threshold_set"], name="chat",
                                 client=admin, body=models.ThresholdSetCreate(
                                     reason="generated client", thresholds=thresholds,
                                     activate=True))
    assert status == 201 and isinstance(published, models.ThresholdSetRead)
    version = published.version
    status, token, _ = _call(ops["auth.create_token"], client=admin, body=models.TokenCreate(
        name="gen-runtime", scope=models.TokenCreateScope.RUNTIME, deployment="chat"))
    assert status == 201 and token.scope == models.TokenCreatedScope.RUNTIME

    # A runtime's calls with its own token: pull (then 304 by ETag), beat, ship, leave.
    runtime = api.AuthenticatedClient(base_url=base, token=token.token,
                                      raise_on_unexpected_status=True)
    status, wire, headers = _call(ops["deployments.pull_thresholds"], name="chat",
                                  client=runtime, runtime_id="gen-1")
    assert status == 200 and isinstance(wire, models.ThresholdPull)
    assert wire.version == version and wire.thresholds.to_dict() == {"3": 0.9, "6": 0.8,
                                                                     "9": 0.7}
    assert headers["etag"].strip('"') == wire.checksum
    status, _, _ = _call(ops["deployments.pull_thresholds"], name="chat", client=runtime,
                         runtime_id="gen-1", if_none_match=headers["etag"])
    assert status == 304
    status, beat, _ = _call(ops["runtimes.heartbeat"], name="chat", client=runtime,
                            body=models.Heartbeat(runtime_id="gen-1", applied_version=version,
                                                  applied_checksum=wire.checksum))
    assert status == 200 and beat.runtime_id == "gen-1" and beat.applied_version == version
    records = [models.TokenRecord(threshold_version=version, request_id="r1", position=i,
                                  exit_layer=6, signal_value=0.85, latency_us=900,
                                  ts=time.time()) for i in range(3)]
    batch = models.TelemetryBatch(batch_id=uuid.uuid4().hex, deployment="chat",
                                  runtime_id="gen-1", seq=0, num_layers=12, records=records)
    status, ack, _ = _call(ops["telemetry.ingest_telemetry"], client=runtime, body=batch)
    assert status == 202 and isinstance(ack, models.IngestAck) and ack.accepted == 3
    status, counts, _ = _call(ops["telemetry.telemetry_count"], name="chat", client=runtime)
    assert status == 200 and counts.records == 3
    status, fleet, _ = _call(ops["runtimes.list_runtimes"], name="chat", client=admin)
    assert [r.runtime_id for r in fleet] == ["gen-1"]
    status, left, _ = _call(ops["runtimes.leave"], name="chat", runtime_id="gen-1",
                            client=runtime)
    assert status == 200 and left.removed == ["gen-1"]
    assert _call(ops["runtimes.list_runtimes"], name="chat", client=admin)[1] == []

    # The documented errors, each read into the one Error model.
    stranger = api.AuthenticatedClient(base_url=base, token="ept_not-a-token",
                                       raise_on_unexpected_status=True)
    status, error, _ = _call(ops["deployments.list_deployments"], client=stranger)
    assert status == 401 and isinstance(error, models.Error) and error.detail
    status, error, _ = _call(ops["deployments.list_deployments"], client=runtime)
    assert status == 403 and isinstance(error, models.Error) and "operator" in error.detail
    status, error, _ = _call(ops["deployments.show_deployment"], name="nowhere", client=admin)
    assert status == 404 and isinstance(error, models.Error) and "nowhere" in error.detail
    status, error, _ = _call(ops["deployments.create_deployment"], client=admin,
                             body=models.DeploymentCreate(name="Not A Name", model_ref="m",
                                                          num_layers=0))
    assert status == 422 and isinstance(error, models.Error) and error.detail
    locations = {tuple(item.loc) for item in error.errors}
    assert locations == {("body", "name"), ("body", "num_layers")}, error.to_dict()
    assert all(item.msg and item.type_ for item in error.errors)
