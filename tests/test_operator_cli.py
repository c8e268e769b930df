"""The operator commands (`exitplane deployments`, `versions`, `rollback`, `canary`,
`calibrations`, `alerts`, `runtimes`, `tokens`, `segments`) run as the installed `exitplane`
program against a control plane started with `exitplane up`: each group does its work over the
HTTP API, `--output json` prints the API's objects, and every failure is one line on stderr
with exit status 1 (the control plane refused) or 2 (bad input, nothing answered). Also the
`db` commands (current, history, downgrade, SQL for DBAs), an unreachable database (for `db`
and `bootstrap token`) and a missing `--thresholds` file, each one line. Users, hooks,
deployment create/update/delete, canary members and the output formats:
tests/test_operator_cli_admin.py.

The store is set up directly only where the API has no route for it (an alert firing, a
calibration candidate waiting for approval)."""

from __future__ import annotations

import json
import shutil
import subprocess

import httpx
import pytest
from click.testing import CliRunner

from exitplane.cli import main
from tests.support.network import free_port
from tests.support.operator_plane import EXITPLANE, ROOT, Ran, clean_env, served_plane

# slow: every test runs `exitplane` processes against a running `exitplane up`
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def plane(sqlite_template, tmp_path_factory):
    with served_plane(sqlite_template, tmp_path_factory.mktemp("operator-cli")) as found:
        yield found


def _active(plane) -> int:
    return plane.http.get("/v1/deployments/chat").json()["aliases"]["active"]


def test_deployments_versions_and_rollback(plane, tmp_path):
    listed = json.loads(plane.run("deployments", "list", "-o", "json", process=True).stdout)
    assert [d["name"] for d in listed] == ["chat"]
    assert listed[0]["exit_layers"] == [2, 4]
    table = plane.run("deployments", "show", "chat").stdout
    assert "exit_layers:" in table and "2,4" in table and "alias active:" in table

    set_file = tmp_path / "set.json"
    set_file.write_text(json.dumps({"signal": "maxprob", "thresholds": {"2": 0.9, "4": 0.8}}))
    first = plane.json("versions", "publish", "chat", "--file", str(set_file), "--reason", "one")
    assert first["thresholds"] == {"2": 0.9, "4": 0.8} and first["aliases"] == []
    second = plane.json("versions", "publish", "chat", "--file", str(set_file),
                        "--threshold", "2=0.85", "--reason", "two", "--activate")
    assert second["thresholds"] == {"2": 0.85, "4": 0.8} and second["aliases"] == ["active"]
    assert _active(plane) == second["version"]

    versions = plane.json("versions", "list", "chat")
    assert [v["version"] for v in versions][:2] == [second["version"], first["version"]]
    assert plane.json("versions", "show", "chat", "active")["version"] == second["version"]
    shown = plane.run("versions", "show", "chat", str(first["version"])).stdout
    assert "thresholds:" in shown and "2:0.9 4:0.8" in shown

    diff = plane.json("versions", "diff", "chat", str(first["version"]))
    assert diff["to"]["version"] == second["version"]
    assert diff["thresholds"][0] == {"layer": 2, "from": 0.9, "to": 0.85, "change": -0.05}
    assert diff["thresholds"][1]["change"] == 0
    assert "-0.05" in plane.run("versions", "diff", "chat", str(first["version"])).stdout

    moved = plane.json("versions", "activate", "chat", str(first["version"]), "--reason", "a")
    assert (moved["from_version"], moved["to_version"]) == (second["version"], first["version"])
    assert _active(plane) == first["version"]
    line = plane.run("rollback", "chat", "--reason", "back").stdout
    assert line.startswith(f"chat: active {first['version']} -> {second['version']}"), line
    assert _active(plane) == second["version"]
    audit = plane.json("deployments", "audit", "chat", "--limit", "2")
    assert [e["action"] for e in audit] == ["alias.rollback", "alias.move"]
    assert audit[0]["reason"] == "back"


def test_canary_start_status_promote_and_revert(plane):
    plane.run("canary", "promote", "chat", "--reason", "none running", code=1)
    active = _active(plane)
    refused = plane.run("canary", "start", "chat", str(active), code=1)
    assert f"version {active} is 'chat''s active version" in refused.stderr
    assert "(HTTP 409)" in refused.stderr
    missing = plane.run("canary", "start", "chat", "999", code=1)
    assert "has no threshold set version 999 (HTTP 404)" in missing.stderr
    for verb in ("promote", "revert"):
        made = plane.json("versions", "publish", "chat", "--threshold", "2=0.95",
                          "--threshold", "4=0.9", "--reason", f"canary candidate to {verb}")
        line = plane.run("canary", "start", "chat", str(made["version"]),
                         "--reason", f"then {verb}").stdout
        assert line.strip() == (f"chat: canary of version {made['version']} running "
                                f"(stable: version {_active(plane)})")
        again = plane.run("canary", "start", "chat", str(made["version"]), code=1)
        assert "already has a running canary" in again.stderr
        audit = plane.json("deployments", "audit", "chat", "--limit", "1")[0]
        assert (audit["action"], audit["to_version"], audit["actor"]) == (
            "canary.start", made["version"], "token:ops")
        assert audit["reason"].endswith(f": then {verb}")
        status = plane.json("canary", "status", "chat")
        assert (status["version"], status["status"]) == (made["version"], "running")
        before = _active(plane)
        run = plane.json("canary", verb, "chat", "--reason", f"{verb} it")
        assert run["status"] == {"promote": "promoted", "revert": "reverted"}[verb]
        assert _active(plane) == (made["version"] if verb == "promote" else before)
    result = plane.run("canary", "revert", "chat", "--reason", "again", code=1)
    assert "has no running or paused canary (HTTP 409)" in result.stderr


def test_calibrations_start_list_approve_reject(plane):
    from controlplane.calibration.models import CalibrationJob

    started = plane.json("calibrations", "start", "chat", "--since", "2h", "--reason", "cli")
    job = started["job"]
    assert started["created"] and job["status"] == "queued" and job["reason"] == "cli"
    again = plane.json("calibrations", "start", "chat")
    assert not again["created"] and again["job"]["id"] == job["id"]
    assert plane.json("calibrations", "list", "chat")[0]["id"] == job["id"]
    assert plane.json("calibrations", "show", "chat", str(job["id"]))["layers"] == []
    refused = plane.run("calibrations", "approve", "chat", str(job["id"]), "--reason", "x",
                        code=1)
    assert "has no candidate waiting for a decision" in refused.stderr

    candidate = plane.json("versions", "publish", "chat", "--threshold", "2=0.7",
                           "--threshold", "4=0.6", "--reason", "calibrated")["version"]
    with plane.session() as session:  # what a finished job under the approval policy leaves
        row = session.get(CalibrationJob, job["id"])
        row.status, row.result_version, row.promotion = "succeeded", candidate, \
            "awaiting_approval"
        session.commit()
    line = plane.run("calibrations", "approve", "chat", str(job["id"]), "--reason", "ok").stdout
    assert line.strip() == f"chat: calibration job {job['id']} approved (version {candidate})"
    assert _active(plane) == candidate

    second = plane.json("calibrations", "start", "chat")["job"]
    with plane.session() as session:
        row = session.get(CalibrationJob, second["id"])
        row.status, row.result_version, row.promotion = "succeeded", candidate, \
            "awaiting_approval"
        session.commit()
    rejected = plane.json("calibrations", "reject", "chat", str(second["id"]), "--reason", "no")
    assert rejected["promotion"] == "rejected" and rejected["decided_by"] == "token:ops"
    plane.run("calibrations", "start", "chat", "--since", "yesterday", code=2)


def test_alerts_list_ack_resolve(plane, outbox):
    from controlplane.alerts.service import Condition, fire
    from controlplane.deployments.service import get_deployment

    with plane.session() as session:
        alert, _ = fire(session=session, deployment=get_deployment(session=session, name="chat"),
                        condition=Condition(kind="exit_rate_collapse", severity="warning",
                                            summary="layer 2 stopped exiting", layer=2))
        session.commit()
        alert_id = alert.id
    listed = plane.json("alerts", "list", "--deployment", "chat", "--status", "open")
    assert [a["id"] for a in listed] == [alert_id]
    table = plane.run("alerts", "list").stdout.splitlines()
    assert table[0].split()[:3] == ["ID", "DEPLOYMENT", "KIND"]
    assert "exit_rate_collapse" in table[1]
    assert plane.json("alerts", "show", str(alert_id))["summary"] == "layer 2 stopped exiting"
    acked = plane.json("alerts", "ack", str(alert_id), "--note", "looking")
    assert acked["status"] == "acknowledged" and acked["acknowledged_by"] == "token:ops"
    line = plane.run("alerts", "resolve", str(alert_id), "--reason", "fixed").stdout
    assert line.strip() == f"alert {alert_id} (exit_rate_collapse, chat): resolved"
    assert plane.json("alerts", "list", "--status", "open") == []
    plane.run("alerts", "ack", "999999", code=1)


def test_tokens_and_runtimes(plane, tmp_path):
    runtime_file = tmp_path / "runtime.token"
    plane.run("tokens", "create", "--name", "rt", "--scope", "runtime", "--deployment", "chat",
              "--out", str(runtime_file))
    assert oct(runtime_file.stat().st_mode & 0o777) == "0o600"
    secret = runtime_file.read_text().strip()
    listed = plane.json("tokens", "list")
    token = next(t for t in listed if t["name"] == "rt")
    assert token["scope"] == "runtime" and secret.startswith(token["prefix"])
    assert token["deployment"] == "chat"
    row = next(line.split() for line in plane.run("tokens", "list").stdout.splitlines()
               if " rt " in line)
    assert row[:4] == [str(token["id"]), "rt", "runtime", "chat"]  # the name, not the id

    for runtime_id in ("rt-a", "rt-b"):
        beat = httpx.post(f"{plane.url}/v1/deployments/chat/heartbeats",
                          json={"runtime_id": runtime_id, "spooled_batches": 3},
                          headers={"Authorization": f"Bearer {secret}"}, timeout=30)
        assert beat.status_code == 200, beat.text
    fleet = plane.json("runtimes", "list", "chat")
    assert sorted(r["runtime_id"] for r in fleet) == ["rt-a", "rt-b"]
    assert {r["spooled_batches"] for r in fleet} == {3}
    assert plane.json("runtimes", "remove", "chat", "rt-a")["removed"] == ["rt-a"]
    line = plane.run("runtimes", "remove", "chat", "--token-id", str(token["id"])).stdout
    assert line.strip() == "chat: removed 1 runtime(s): rt-b"
    assert plane.json("runtimes", "list", "chat") == []
    plane.run("runtimes", "remove", "chat", code=2)  # neither a runtime nor a token

    printed = plane.run("tokens", "create", "--name", "op", "--scope", "operator").stdout
    operator_file = tmp_path / "operator.token"
    operator_file.write_text(printed)
    assert plane.run("deployments", "list", "--token-file", str(operator_file)).stdout
    refused = plane.run("tokens", "list", "--token-file", str(operator_file), code=1)
    assert "(HTTP 403)" in refused.stderr
    operator_id = next(t["id"] for t in plane.json("tokens", "list") if t["name"] == "op")
    revoked = plane.json("tokens", "revoke", str(operator_id))
    assert revoked["revoked_at"] is not None
    refused = plane.run("deployments", "list", "--token-file", str(operator_file), code=1)
    assert "(HTTP 401)" in refused.stderr


def test_segments_declare_list_remove(plane):
    row = plane.json("segments", "declare", "chat", "code", "--reason", "code traffic")
    assert (row["name"], row["origin"], row["removed_at"]) == ("code", "operator", None)
    registry = plane.json("segments", "list", "chat")
    assert [s["name"] for s in registry["segments"]] == ["code"]
    assert plane.run("segments", "list", "chat").stdout.splitlines()[1].split()[:3] == \
        ["code", "in", "use"]
    assert plane.json("segments", "remove", "chat", "code")["removed_at"] is not None
    plane.run("segments", "declare", "chat", "Not A Name", code=1)


def test_deployments_shadow_rate_shows_and_bounds_the_rate(plane):
    shown = plane.json("deployments", "shadow-rate", "chat")
    assert (shown["shadow_rate_min"], shown["shadow_rate_max"]) == (0.01, 0.2)
    fixed = plane.json("deployments", "shadow-rate", "chat", "--fixed", "0.05")
    assert (fixed["shadow_rate"], fixed["shadow_rate_reason"]) == (
        0.05, "fixed by the operator at 0.05")
    opened = plane.json("deployments", "shadow-rate", "chat", "--min", "0.01", "--max", "0.2")
    assert (opened["shadow_rate_min"], opened["shadow_rate_max"], opened["shadow_rate"]) == (
        0.01, 0.2, 0.05)  # within the new bounds: kept until the workers decide again
    text = plane.run("deployments", "shadow-rate", "chat").stdout
    assert "fixed by the operator at 0.05" in text
    refused = plane.run("deployments", "shadow-rate", "chat", "--min", "0.5", "--max", "0.1",
                        code=1)
    assert "must not exceed" in refused.stderr
    plane.run("deployments", "shadow-rate", "chat", "--fixed", "0.1", "--min", "0.1", code=2)


def test_failures_are_one_line_with_their_exit_status(plane, tmp_path):
    closed = free_port()
    down = plane.run("deployments", "list", "--url", f"http://127.0.0.1:{closed}", code=2,
                     process=True)
    assert down.stderr == f"exitplane: cannot reach http://127.0.0.1:{closed}: connection refused\n"
    plane.run("deployments", "list", "--url", "ftp://example", code=2)
    api_path = plane.run("deployments", "list", "--url", f"{plane.url}/v1/", code=2)
    assert "ends in /v1: give its base URL" in api_path.stderr

    bogus = tmp_path / "bogus.token"
    bogus.write_text("ep_not-a-token\n")
    bad = plane.run("deployments", "list", "--token-file", str(bogus), code=1, process=True)
    assert bad.stderr.startswith("exitplane: unknown API token") and "(HTTP 401)" in bad.stderr
    missing = plane.run("deployments", "list", "--token-file", str(tmp_path / "nope"), code=2)
    assert missing.stderr.startswith(f"exitplane: cannot read the token file {tmp_path}/nope")
    plane.run("deployments", "list", code=2, EXITPLANE_TOKEN_FILE=None)  # no token at all

    gone = plane.run("deployments", "show", "nope", code=1, process=True)
    assert gone.stderr == "exitplane: deployment 'nope' does not exist (HTTP 404)\n"
    plane.run("versions", "show", "chat", "latest", code=2)
    plane.run("versions", "publish", "chat", "--reason", "x", code=2)  # no thresholds
    absent = plane.run("versions", "publish", "chat", "--file", str(tmp_path / "none.json"),
                       "--reason", "x", code=2)
    assert absent.stderr == (f"exitplane: cannot read {tmp_path}/none.json: No such file or "
                             "directory\n")
    garbled = tmp_path / "garbled.json"
    garbled.write_text("{thresholds")
    plane.run("versions", "publish", "chat", "--file", str(garbled), "--reason", "x", code=2)
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"thresholds": {"3": 0.5}}))
    refused = plane.run("versions", "publish", "chat", "--file", str(unknown), "--reason", "x",
                        code=1)
    assert "(HTTP 422)" in refused.stderr


def test_db_commands_and_an_unreachable_database(sqlite_template, tmp_path, monkeypatch):
    from controlplane.settings import get_settings

    db_path = tmp_path / "exitplane.db"
    shutil.copy(sqlite_template, db_path)
    sqlite = f"sqlite:///{db_path}"
    postgres = "postgresql+psycopg://exitplane:secret@127.0.0.1:1/exitplane"
    monkeypatch.setenv("EXITPLANE_VAR_DIR", str(tmp_path / "var"))

    def run(*args: str, code: int = 0, url: str = sqlite) -> Ran:
        monkeypatch.setenv("EXITPLANE_DATABASE_URL", url)
        get_settings.cache_clear()  # settings are read once per process
        result = CliRunner().invoke(main, list(args), catch_exceptions=False)
        get_settings.cache_clear()
        assert result.exit_code == code, (args, result.stdout, result.stderr)
        if code:
            assert result.stderr.startswith("exitplane: ") and \
                result.stderr.count("\n") == 1, result.stderr
        return Ran(result.exit_code, result.stdout, result.stderr)

    history = run("db", "history").stdout.splitlines()
    head, previous = history[0].split()[0], history[1].split()[0]
    assert "(head)" in history[0] and history[-1].split(" <- ")[1].startswith("(base)")
    assert run("db", "current").stdout.strip() == f"{head} (head)"
    run("db", "downgrade", previous, "--yes")
    assert run("db", "current", code=1).stdout.strip() == previous  # behind the head: exit 1
    run("db", "upgrade")
    assert run("db", "current").stdout.strip() == f"{head} (head)"
    run("db", "downgrade", "no-such-revision", "--yes", code=2)

    sql = run("db", "upgrade", "--sql", "--from", previous).stdout
    assert f"Running upgrade {previous} -> {head}" in sql and "alembic_version" in sql
    sql = run("db", "upgrade", "--sql", "--from", "0006", "--revision", "0007_segments",
              url=postgres).stdout  # offline: nothing connects to the database
    assert "ALTER TABLE" in sql and "COMMIT;" in sql
    down = run("db", "downgrade", "--sql", "--from", head, previous).stdout
    assert f"Running downgrade {head} -> {previous}" in down
    run("db", "downgrade", "--sql", previous, code=2)  # --from is needed
    whole = run("db", "upgrade", "--sql", code=2)  # a migration that rewrites stored rows
    assert "rewrites stored rows and cannot be written as SQL" in whole.stderr

    for args in (("db", "current"), ("db", "upgrade"),
                 ("bootstrap", "token", "--name", "x", "--scope", "admin")):
        failed = run(*args, code=2, url=postgres)
        assert failed.stderr.startswith(
            "exitplane: cannot reach the database at "
            "postgresql+psycopg://exitplane:***@127.0.0.1:1/exitplane: "), failed.stderr
        assert "secret" not in failed.stderr
    # The installed program says the same in one line, without a traceback.
    done = subprocess.run([EXITPLANE, "db", "current"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120,
                          env=clean_env(EXITPLANE_DATABASE_URL=postgres,
                                         EXITPLANE_VAR_DIR=str(tmp_path / "var")))
    assert done.returncode == 2 and done.stderr == failed.stderr, done.stderr


def test_a_missing_thresholds_file_is_one_line(tmp_path):
    env = clean_env(EXITPLANE_VAR_DIR=str(tmp_path))
    for command in ("generate", "serve"):
        extra = ["--prompt", "hi"] if command == "generate" else []
        done = subprocess.run([EXITPLANE, "runtime", command, *extra, "--thresholds",
                               str(tmp_path / "none.json")], cwd=ROOT, env=env, text=True,
                              capture_output=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert done.stderr == (f"Error: cannot read the threshold set {tmp_path}/none.json: "
                               "No such file or directory\n")
