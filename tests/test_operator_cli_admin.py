"""Every admin object over the API, from the `exitplane` program against a control plane
started with `exitplane up`: deployments created, updated and deleted (a deletion asks first,
is refused while runtimes are live unless forced, revokes the deployment's runtime tokens and
leaves an audit event); UI users listed, created, re-roled, given a new password, disabled and
enabled; alert hooks listed, created, changed, tested against a real receiver and deleted; a
canary that no live runtime falls into warns, lists its members and changes its fraction.
Also the output formats (json, yaml, name, --no-headers) and the connection options given
before the command's name, on the root or on its group."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import yaml

from controlplane.deployments.service import in_canary
from tests.support.network import free_port
from tests.support.operator_plane import served_plane

# slow: every test runs `exitplane` commands against a running `exitplane up`
pytestmark = pytest.mark.slow

PASSWORD = "correct horse battery staple"


@pytest.fixture(scope="module")
def plane(sqlite_template, tmp_path_factory):
    with served_plane(sqlite_template, tmp_path_factory.mktemp("operator-admin"),
                      EXITPLANE_HOOK_ALLOWED_HOSTS="127.0.0.1") as found:
        yield found


def _runtime_token(plane, deployment: str, tmp_path) -> str:
    out = tmp_path / f"{deployment}.token"
    plane.run("tokens", "create", "--name", f"rt-{deployment}", "--scope", "runtime",
              "--deployment", deployment, "--out", str(out))
    return out.read_text().strip()


def _beat(plane, deployment: str, secret: str, runtime_id: str) -> None:
    answer = httpx.post(f"{plane.url}/v1/deployments/{deployment}/heartbeats",
                        json={"runtime_id": runtime_id},
                        headers={"Authorization": f"Bearer {secret}"}, timeout=30)
    assert answer.status_code == 200, answer.text


def _operator_token(plane, tmp_path) -> str:
    path = tmp_path / "operator.token"
    path.write_text(plane.run("tokens", "create", "--name", "op", "--scope",
                              "operator").stdout)
    return str(path)


def test_deployments_create_update_and_delete(plane, tmp_path):
    made = plane.json("deployments", "create", "typo", "--model-ref", "tiny-llama",
                      "--num-layers", "6", "--exit-layers", "2,4", "--signal", "maxprob",
                      "--delta", "0.05", "--policy", "approval")
    assert (made["exit_layers"], made["delta"], made["policy"]) == ([2, 4], 0.05, "approval")
    assert made["aliases"] == {"active": 1, "conservative": 1}
    changed = plane.json("deployments", "update", "typo", "--delta", "0.02",
                         "--canary-fraction", "0.5", "--set", "fallback_mode=last_good")
    assert (changed["delta"], changed["canary_fraction"], changed["fallback_mode"]) == (
        0.02, 0.5, "last_good")
    plane.run("deployments", "update", "typo", code=2)  # nothing to change
    plane.run("deployments", "update", "typo", "--set", "delta", code=2)
    refused = plane.run("deployments", "update", "typo", "--set", "delta=2", code=1)
    assert "(HTTP 422)" in refused.stderr
    taken = plane.run("deployments", "create", "typo", "--model-ref", "m", "--num-layers", "6",
                      code=1)
    assert "already exists (HTTP 409)" in taken.stderr

    secret = _runtime_token(plane, "typo", tmp_path)
    _beat(plane, "typo", secret, "rt-live")
    kept = plane.run("deployments", "delete", "typo", "--reason", "typo", input="n\n", code=1)
    assert kept.stderr.rstrip().endswith("exitplane: nothing deleted (--yes deletes without "
                                         "asking)")
    assert plane.http.get("/v1/deployments/typo").status_code == 200
    operator = _operator_token(plane, tmp_path)
    denied = plane.run("deployments", "delete", "typo", "--reason", "x", "--yes",
                       "--token-file", operator, code=1)
    assert "(HTTP 403)" in denied.stderr
    live = plane.run("deployments", "delete", "typo", "--reason", "typo", "--yes", code=1)
    assert "has 1 live runtime(s) (rt-live)" in live.stderr and "(HTTP 409)" in live.stderr
    plane.run("deployments", "delete", "typo", "--yes", code=2, usage=True)  # needs --reason

    gone = plane.json("deployments", "delete", "typo", "--reason", "mistyped", "--force",
                      "--yes")
    assert gone["name"] == "typo" and gone["threshold_sets"] == 1
    assert gone["live_runtimes"] == ["rt-live"] and len(gone["revoked_tokens"]) == 1
    assert plane.http.get("/v1/deployments/typo").status_code == 404
    assert "typo" not in plane.run("deployments", "list", "-o", "name").stdout.split()
    pull = httpx.get(f"{plane.url}/v1/deployments/typo/thresholds",
                     params={"runtime_id": "rt-live"},
                     headers={"Authorization": f"Bearer {secret}"}, timeout=30)
    assert pull.status_code == 401, pull.text  # the runtime token went with it
    events = plane.http.get("/v1/audit", params={"action": "deployment.delete"}).json()
    assert [(e["actor"], e["target"], e["reason"]) for e in events] == [
        ("token:ops", "deployment:typo", "mistyped")]
    again = plane.run("deployments", "delete", "typo", "--reason", "x", "--yes", code=1)
    assert "deployment 'typo' does not exist (HTTP 404)" in again.stderr


def test_users_over_the_api(plane, tmp_path):
    password = tmp_path / "password"
    password.write_text(PASSWORD + "\n")
    line = plane.run("users", "create", "ana", "--role", "operator", "--password-file",
                     str(password)).stdout
    assert line.strip() == "user ana created (role operator)"
    assert "ana" in plane.run("users", "list", "-o", "name").stdout.split()
    table = plane.run("users", "list").stdout.splitlines()
    assert table[0].split()[:3] == ["USERNAME", "ROLE", "DISABLED"]
    assert plane.json("users", "update", "ana", "--role", "viewer")["role"] == "viewer"
    assert plane.json("users", "disable", "ana")["disabled"] is True
    assert plane.run("users", "show", "ana").stdout.splitlines()[2].split() == [
        "disabled:", "yes"]
    assert plane.json("users", "enable", "ana")["disabled"] is False
    newer = tmp_path / "newer"
    newer.write_text(PASSWORD + " again")
    plane.run("users", "update", "ana", "--password-file", str(newer))
    actions = [e["action"] for e in plane.http.get("/v1/audit", params={"limit": 6}).json()]
    assert actions[:5] == ["user.password", "user.enable", "user.disable", "user.role",
                           "user.create"]

    short = tmp_path / "short"
    short.write_text("short")
    refused = plane.run("users", "create", "bo", "--role", "viewer", "--password-file",
                        str(short), code=1)
    assert "(HTTP 422)" in refused.stderr
    assert "does not exist (HTTP 404)" in plane.run("users", "disable", "nobody",
                                                    code=1).stderr
    plane.run("users", "update", "ana", code=2)  # nothing to change
    operator = _operator_token(plane, tmp_path)
    assert "(HTTP 403)" in plane.run("users", "list", "--token-file", operator,
                                     code=1).stderr


class Receiver(BaseHTTPRequestHandler):
    """An alert hook's receiver: keeps each POST's path and body."""

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        self.server.received.append((self.path, json.loads(self.rfile.read(length))))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_args) -> None:
        pass


@pytest.fixture
def receiver():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    server.received = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_hooks_over_the_api(plane, receiver):
    url = f"http://127.0.0.1:{receiver.server_address[1]}/hook"
    made = plane.json("hooks", "create", "--name", "pager", "--kind", "webhook",
                      "--endpoint", url, "--deployment", "chat")
    assert (made["deployment"], made["enabled"], made["has_secret"]) == ("chat", True, True)
    assert made["secret"]  # shown once
    hook = str(made["id"])
    assert plane.run("hooks", "list", "-o", "name").stdout.split() == [hook]
    shown = plane.json("hooks", "show", hook)  # the URL without its path (it may hold secrets)
    assert shown["url"].startswith(f"http://127.0.0.1:{receiver.server_address[1]}/")
    assert plane.json("hooks", "update", hook, "--disable")["enabled"] is False
    updated = plane.json("hooks", "update", hook, "--enable", "--min-severity", "critical")
    assert (updated["enabled"], updated["min_severity"]) == (True, "critical")
    plane.run("hooks", "update", hook, code=2)  # nothing to change

    line = plane.run("hooks", "test", hook).stdout
    assert line.strip() == f"hook {hook}: test delivery delivered (HTTP 200)"
    assert [path for path, _ in receiver.received] == ["/hook"]

    closed = plane.json("hooks", "create", "--name", "nowhere", "--kind", "webhook",
                        "--endpoint", f"http://127.0.0.1:{free_port()}/hook")
    failed = plane.run("hooks", "test", str(closed["id"]), code=1)
    assert f"exitplane: hook {closed['id']}: the receiver did not take the test alert" in \
        failed.stderr
    bad = plane.run("hooks", "create", "--name", "x", "--kind", "carrier-pigeon",
                    "--endpoint", url, code=1)
    assert "(HTTP 422)" in bad.stderr

    plane.run("hooks", "delete", hook, input="n\n", code=1)
    assert plane.http.get(f"/v1/hooks/{hook}").status_code == 200
    for made_id in (hook, str(closed["id"])):
        assert plane.run("hooks", "delete", made_id, "--yes").stdout.strip() == \
            f"hook {made_id} deleted"
    assert plane.json("hooks", "list") == []


def test_a_canary_without_live_members_warns_and_lists_its_members(plane, tmp_path):
    plane.run("deployments", "create", "cn", "--model-ref", "tiny-llama", "--num-layers", "6",
              "--exit-layers", "2,4", "--signal", "maxprob")
    candidate = plane.json("versions", "publish", "cn", "--threshold", "2=0.9",
                           "--threshold", "4=0.8", "--reason", "candidate")["version"]
    # A refused start changes nothing, its fraction included (one transaction).
    before = plane.json("deployments", "show", "cn")["canary_fraction"]
    refused = plane.run("canary", "start", "cn", "1", "--fraction", "0.3", "--reason", "no",
                        code=1)
    assert "active version" in refused.stderr and before != 0.3
    assert plane.json("deployments", "show", "cn")["canary_fraction"] == before
    started = plane.run("canary", "start", "cn", str(candidate), "--fraction", "0.5",
                        "--reason", "first canary")
    assert started.stdout.strip() == f"cn: canary of version {candidate} running (stable: " \
                                     "version 1)"
    assert started.stderr.startswith("exitplane: warning: no live runtime of 'cn' falls into "
                                     "the canary (50% of 0 live runtime(s))")
    run = plane.json("canary", "status", "cn")
    assert (run["canary_fraction"], run["live_runtimes"], run["members"]) == (0.5, 0, [])
    assert len(run["warnings"]) == 1
    assert plane.json("canary", "members", "cn") == []

    secret = _runtime_token(plane, "cn", tmp_path)
    runtime_ids = [f"rt-{index}" for index in range(6)]
    for runtime_id in runtime_ids:
        _beat(plane, "cn", secret, runtime_id)
    changed = plane.run("canary", "fraction", "cn", "1")
    assert changed.stdout.strip() == "cn: canary fraction 1" and changed.stderr == ""
    assert plane.run("canary", "members", "cn", "-o", "name").stdout.split() == runtime_ids
    table = plane.run("canary", "members", "cn")
    assert table.stdout.splitlines()[0].split() == ["RUNTIME", "VERSION", "LAST", "SEEN"]
    assert table.stderr.startswith(f"cn: 6 of 6 live runtime(s) in the canary of version "
                                   f"{candidate} (running, fraction 1)")

    # Below the smallest bucket of the six ids, no runtime falls into the canary.
    fraction = min(bucket for bucket in (
        next(f / 1000 for f in range(1, 1001) if in_canary(runtime_id=r, fraction=f / 1000))
        for r in runtime_ids)) / 2
    assert not any(in_canary(runtime_id=r, fraction=fraction) for r in runtime_ids)
    narrowed = plane.run("canary", "fraction", "cn", f"{fraction:.6f}")
    assert "exitplane: warning: no live runtime of 'cn' falls into the canary" in \
        narrowed.stderr
    assert plane.json("canary", "members", "cn") == []
    plane.run("canary", "fraction", "cn", "0", code=2, usage=True)
    plane.run("canary", "revert", "cn", "--reason", "done")
    assert plane.json("canary", "status", "cn")["warnings"] == []  # reverted: nothing to judge


def test_output_formats_and_options_before_the_command(plane):
    listed = json.loads(plane.run("-o", "json", "deployments", "list").stdout)
    assert "chat" in [d["name"] for d in listed]
    shown = yaml.safe_load(plane.run("deployments", "-o", "yaml", "show", "chat").stdout)
    assert shown["name"] == "chat" and shown["exit_layers"] == [2, 4]
    names = plane.run("deployments", "list", "-o", "name").stdout.split()
    assert "chat" in names and names == sorted(names)
    headed = plane.run("deployments", "list").stdout.splitlines()
    bare = plane.run("--no-headers", "deployments", "list").stdout.splitlines()
    assert headed[0].startswith("NAME")
    assert [line.split() for line in bare] == [line.split() for line in headed[1:]]
    assert plane.run("deployments", "list", "--no-headers", "-o", "name").stdout.split() == \
        names
    versions = plane.run("versions", "list", "chat", "-o", "name").stdout.split()
    assert versions and all(v.isdigit() for v in versions)

    # the root's and the group's options beat the environment; the command's own beat both
    nowhere = f"http://127.0.0.1:{free_port()}"
    plane.run("--url", plane.url, "deployments", "list", EXITPLANE_URL=nowhere)
    plane.run("deployments", "--url", plane.url, "list", EXITPLANE_URL=nowhere)
    plane.run("--url", nowhere, "deployments", "list", "--url", plane.url)
    down = plane.run("--url", plane.url, "deployments", "--url", nowhere, "list", code=2)
    assert down.stderr == f"exitplane: cannot reach {nowhere}: connection refused\n"
    plane.run("--timeout", "5", "--token-file", str(plane.token_file), "tokens", "list",
              EXITPLANE_TOKEN_FILE=None, process=True)
    assert json.loads(plane.run("alerts", "list", EXITPLANE_OUTPUT="json").stdout) == []
    assert plane.run("-o", "table", "alerts", "list", EXITPLANE_OUTPUT="json").stdout \
        .startswith("ID")
    plane.run("-o", "xml", "deployments", "list", code=2, usage=True)


def test_a_singular_group_runs_the_plural_groups_commands(plane):
    """`exitplane token list` (a command only `tokens` has) runs it, after the deprecation
    line."""
    old = plane.run("token", "list", "-o", "name")
    assert old.stderr.startswith("exitplane: `exitplane token` is deprecated; use `exitplane "
                                 "bootstrap token` (database access) or `exitplane tokens`")
    assert old.stdout == plane.run("tokens", "list", "-o", "name").stdout != ""
    shown = plane.run("deployment", "show", "chat", "-o", "json")
    assert shown.stderr.count("\n") == 1 and '"name": "chat"' in shown.stdout


def test_calibrations_start_wait_gives_up_after_its_timeout(plane):
    """No worker runs here: the job stays queued, and --wait ends after --wait-timeout with
    exit status 1, leaving the job to the workers."""
    waited = plane.run("calibrations", "start", "chat", "--reason", "waiting", "--wait",
                       "--wait-timeout", "1", input="", code=1)
    job = plane.json("calibrations", "list", "chat")[0]
    assert waited.stderr.splitlines()[-1] == (
        f"exitplane: calibration job {job['id']} is still queued after 1 s (no reason given);"
        f" follow it with `exitplane calibrations show chat {job['id']}`")
    assert job["status"] == "queued" and job["reason"] == "waiting"
