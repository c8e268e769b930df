"""A runtime that refuses its deployment's threshold sets shows it in the fleet view: its
heartbeats carry the refused version (`refused_version`) beside the reason (`error`), the
control plane stores both per runtime, and the fleet list (the API, `exitplane runtimes list`)
shows them until the runtime applies a set the control plane gives. A runtime refusing nothing
leaves the field out of its heartbeats."""

from __future__ import annotations

import json

import httpx
import pytest
from click.testing import CliRunner

from exitplane.client.thresholds import ThresholdClient
from exitplane.wire import Heartbeat
from tests.support.runtime_link import DEPLOYMENT, EXIT_LAYERS, publish
from tests.support.waiting import patient_get, wait_until

FAST = {"backoff_initial_s": 0.05, "backoff_max_s": 0.3, "request_timeout_s": 10.0,
        "long_poll_s": 0.3, "heartbeat_interval_s": 0.3}


def _row(operator: httpx.Client, runtime_id: str) -> dict:
    rows = patient_get(operator, f"/v1/deployments/{DEPLOYMENT}/runtimes").json()
    return next((row for row in rows if row["runtime_id"] == runtime_id), {})


def _engine(tiny_model, exit_layers):
    from runtime.engine import Engine, EngineConfig

    return Engine(tiny_model, exit_layers=exit_layers,
                  config=EngineConfig(max_batch=2, max_seq_len=64))


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_refusing_runtime_shows_the_refused_version_and_why(
        control_plane, operator, runtime_token, tiny_model, tokens, tmp_path):
    version = publish(operator, {2: 0.9, 4: 0.8})
    # heads for layer 4 only: every set of this deployment (layers 2 and 4) is refused
    refusing = ThresholdClient(_engine(tiny_model, [EXIT_LAYERS[-1]]), base_url=control_plane.url,
                               deployment=DEPLOYMENT, token=runtime_token,
                               runtime_id="rt-refuses", **FAST).start()
    try:
        wait_until(lambda: _row(operator, "rt-refuses").get("refused_version") == version,
                   message="a heartbeat naming the refused version")
        assert refusing.refused_version == version
    finally:
        refusing.stop()
    row = _row(operator, "rt-refuses")
    assert row["ready"] is False and row["applied_version"] == 0  # the built-in set
    assert row["error"] == (f"refused threshold set: set v{version} has exit layers "
                            f"{EXIT_LAYERS}; this runtime exits at [4]")

    (tmp_path / "ops.token").write_text(tokens.operator + "\n")
    common = ["--url", control_plane.url, "--token-file", str(tmp_path / "ops.token")]
    from exitplane.cli import main

    listed = CliRunner().invoke(main, ["runtimes", "list", DEPLOYMENT, *common],
                                terminal_width=200)
    assert listed.exit_code == 0, listed.output
    [header, line] = listed.output.splitlines()
    assert "REFUSED" in header and "ERROR" in header
    assert line.split()[0] == "rt-refuses"
    assert f" {version} " in line[header.index("REFUSED") - 1:]
    assert "refused threshold set: set v" in line
    as_json = CliRunner().invoke(main, ["runtimes", "list", DEPLOYMENT, *common, "-o", "json"])
    [listed_row] = json.loads(as_json.output)
    assert (listed_row["refused_version"], listed_row["error"]) == (version, row["error"])

    # the same runtime with heads that fit: it applies the set, and the refusal clears
    fitting = ThresholdClient(_engine(tiny_model, EXIT_LAYERS), base_url=control_plane.url,
                              deployment=DEPLOYMENT, token=runtime_token,
                              runtime_id="rt-refuses", **FAST).start()
    try:
        wait_until(lambda: _row(operator, "rt-refuses").get("applied_version") == version,
                   message="a heartbeat applying the set")
    finally:
        fitting.stop()
    row = _row(operator, "rt-refuses")
    assert (row["ready"], row["refused_version"], row["error"]) == (True, None, None)


def test_a_heartbeat_leaves_refused_version_out_when_there_is_none():
    quiet = json.loads(Heartbeat(runtime_id="rt-1", applied_version=3).model_dump_json())
    assert "refused_version" not in quiet
    refusing = json.loads(Heartbeat(runtime_id="rt-1", applied_version=3,
                                    refused_version=4).model_dump_json())
    assert refusing["refused_version"] == 4
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        Heartbeat(runtime_id="rt-1", refused_version=-1)
