"""Secrets never reach the logs.

Realistic flows run while every log record is captured: tokens created (API, UI, CLI), a UI
sign-in with a password (and a wrong one), webhooks whose URLs carry a key and whose receiver
echoes the request path, alert deliveries as the workers make them, telemetry, heartbeats and
pulls with a runtime token, refused tokens, a database URL with a password, a real secret
key. Then none of the secret strings may appear anywhere in what was logged or printed.

In process the root logger is at DEBUG, as `exitplane worker --loglevel=debug` sets it; a real
`exitplane up` (debug level, access log on) is run too and its output read.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from pydantic import ValidationError
from sqlalchemy import insert
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from controlplane.alerts.models import AlertHook
from controlplane.auth.users import create_user
from controlplane.db import make_engine
from controlplane.settings import Settings
from tests.support.batches import telemetry_batch
from tests.support.network import free_port, serve_in_thread
from tests.support.services import BACKENDS

pytestmark = pytest.mark.usefixtures("quick_hashing", "outbox")

TOKEN = re.compile(r"ept_[A-Za-z0-9_-]{20,}")
CSRF_FIELD = re.compile(r'name="csrf_token" value="([^"]+)"')
LAYERS = {"3": 0.9, "6": 0.85, "9": 0.8}


def _secret(kind: str) -> str:
    return f"{kind}{secrets.token_hex(12)}"


class Secrets:
    """The secret strings of one test; `leaks(text)` names those found in `text`."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def add(self, label: str, value: str) -> str:
        self.values[label] = value
        return value

    def leaks(self, text: str) -> list[str]:
        found = []
        for label, value in self.values.items():
            # A token's tail alone is still most of the secret (its first 12 characters are
            # the stored, displayable prefix).
            needles = [value] + ([value[12:]] if value.startswith("ept_") else [])
            if any(needle in text for needle in needles):
                found.append(label)
        return found


def with_password(url: str, password: str) -> str:
    """`url` with `password` for its user (PostgreSQL's test server trusts loopback, so any
    password connects); SQLite URLs have no password to add."""
    if url.startswith("sqlite"):
        return url
    return make_url(url).set(password=password).render_as_string(hide_password=False)


class EchoingReceiver(BaseHTTPRequestHandler):
    """A hook receiver that answers 404 and, like many web frameworks' error pages, echoes
    the path it was asked for."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        body = f"Cannot POST {self.path}".encode()
        self.send_response(404)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), EchoingReceiver)
    serve_in_thread(server)
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def hidden() -> Secrets:
    return Secrets()


@pytest.fixture
def settings(db_url, tmp_path, hidden):
    """Overrides the shared one: a database password (PostgreSQL) and a real secret key."""
    url = with_password(db_url, hidden.add("database password", _secret("dbpw")))
    return Settings(database_url=url, var_dir=tmp_path / "var", environment="production",
                    secret_key=hidden.add("secret key", _secret("sk") * 2),
                    config_cache_ttl_s=0.2)


@pytest.fixture
def engine(settings) -> Iterator:
    engine = make_engine(settings.database_url)
    yield engine
    engine.dispose()


class Collector(logging.Handler):
    """Keeps every record, formatted at once (with its traceback), as a log file would."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    def text(self) -> str:
        return "\n".join(self.lines)


@pytest.fixture
def everything_logged() -> Iterator[Collector]:
    """Every record any logger emits at DEBUG and above, loggers that do not propagate too:
    the root logger at DEBUG, as `exitplane worker --loglevel=debug` sets it."""
    collector = Collector()
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.DEBUG)
    root.addHandler(collector)
    islands = [logger for logger in logging.root.manager.loggerDict.values()
               if isinstance(logger, logging.Logger) and not logger.propagate]
    for logger in islands:
        logger.addHandler(collector)
    yield collector
    for logger in islands:
        logger.removeHandler(collector)
    root.removeHandler(collector)
    root.setLevel(level)


def _csrf(client, page: str) -> str:
    match = CSRF_FIELD.search(client.get(page).text)
    assert match, f"{page} has no CSRF field"
    return match.group(1)


def _batch(seq: int) -> dict:
    now = time.time()
    return telemetry_batch([{"threshold_version": 2, "request_id": "r1", "position": i,
                             "exit_layer": 6, "signal_value": 0.9, "latency_us": 3000,
                             "ts": now + i} for i in range(4)],
                           batch_id=f"logs-batch-{seq}", seq=seq, num_layers=12)


def test_flows_log_no_secret(app, client, tokens, engine, settings, hidden, receiver,
                             outbox, everything_logged, capfd):
    from fastapi.testclient import TestClient

    from controlplane.alerts import delivery_service, hook_service
    from controlplane.alerts import service as alerts
    from controlplane.alerts.service import Condition
    from controlplane.deployments.service import get_deployment

    hidden.add("admin token", tokens.admin)
    hidden.add("operator token", tokens.operator)
    admin, operator = tokens.headers(tokens.admin), tokens.headers(tokens.operator)
    assert client.post("/v1/deployments", headers=operator, json={
        "name": "chat", "model_ref": "m", "num_layers": 12, "exit_layers": [3, 6, 9]}
    ).status_code == 201
    assert client.post("/v1/deployments/chat/threshold-sets", headers=operator, json={
        "thresholds": LAYERS, "reason": "first", "activate": True}).status_code == 201

    # Tokens created over the API, then used by a runtime: pull, heartbeat, telemetry.
    made = client.post("/v1/tokens", headers=admin, json={
        "name": "rt", "scope": "runtime", "deployment": "chat"})
    assert made.status_code == 201
    runtime = {"Authorization": f"Bearer {hidden.add('runtime token', made.json()['token'])}"}
    pulled = client.get("/v1/deployments/chat/thresholds", params={"runtime_id": "rt-1"},
                        headers=runtime)
    assert pulled.status_code == 200
    assert client.get("/v1/deployments/chat/thresholds", params={"runtime_id": "rt-1"},
                      headers={**runtime, "If-None-Match": pulled.headers["etag"]}
                      ).status_code == 304
    assert client.post("/v1/deployments/chat/heartbeats", headers=runtime, json={
        "runtime_id": "rt-1", "applied_version": 2}).status_code == 200
    for seq in range(2):
        assert client.post("/v1/telemetry", headers=runtime,
                           json=_batch(seq)).status_code == 202
    assert client.post("/v1/telemetry", headers=runtime, json=_batch(0)).status_code == 202

    # Refused tokens: a wrong one, a revoked one, one sent without the Bearer scheme.
    wrong = hidden.add("mistyped token", "ept_" + secrets.token_urlsafe(32))
    assert client.get("/v1/deployments", headers=tokens.headers(wrong)).status_code == 401
    doomed = client.post("/v1/tokens", headers=admin, json={"name": "old", "scope": "operator"})
    hidden.add("revoked token", doomed.json()["token"])
    assert client.delete(f"/v1/tokens/{doomed.json()['id']}", headers=admin).status_code == 200
    assert client.get("/v1/deployments",
                      headers=tokens.headers(doomed.json()["token"])).status_code == 401
    assert client.get("/v1/deployments",
                      headers={"Authorization": tokens.operator}).status_code == 401

    # Webhooks whose URLs carry keys: one answering 404 with the path echoed, one whose port
    # is closed, one with a password in the URL; each tested, then sent a real alert.
    key_in_path = hidden.add("hook URL path key", _secret("pathkey"))
    key_in_query = hidden.add("hook URL query key", _secret("querykey"))
    password_in_url = hidden.add("hook URL password", _secret("urlpw"))
    hook_secret = hidden.add("hook HMAC secret", _secret("hmac"))
    urls = [f"{receiver}/services/{key_in_path}?token={key_in_query}",
            f"http://127.0.0.1:{free_port()}/hooks/{key_in_path}",
            f"http://bot:{password_in_url}@{receiver.removeprefix('http://')}/hook"]
    hook_ids = []
    for index, url in enumerate(urls):
        created = client.post("/v1/hooks", headers=admin, json={
            "name": f"hook {index}", "kind": "webhook", "url": url, "secret": hook_secret,
            "deployment": "chat"})
        assert created.status_code == 201, created.text
        hook_ids.append(created.json()["id"])
        tested = client.post(f"/v1/hooks/{hook_ids[-1]}/test", headers=admin)
        assert tested.status_code == 200 and not tested.json()["ok"]
    generated = client.post("/v1/hooks", headers=admin, json={
        "name": "generated", "kind": "webhook", "url": f"{receiver}/plain"})
    hidden.add("generated hook secret", generated.json()["secret"])
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        alerts.fire(session=session, deployment=deployment, condition=Condition(
            kind="distribution_drift", severity="warning", layer=6, subject="6",
            summary="signal distribution at layer 6 drifted"))
        session.commit()
    deliveries = [args for name, args in outbox if name == "alerts.deliver"]
    assert len(deliveries) >= 3
    for alert_id, hook_id, event in deliveries:  # what the worker's task does
        with Session(engine) as session:
            delivery = delivery_service.deliver(
                session=session, alert_id=alert_id, hook_id=hook_id, event=event,
                base_url=settings.base_url, timeout_s=5, guard=hook_service.hook_guard(settings))
            assert delivery is not None and not delivery.ok
            session.commit()

    # The admin UI: a person signs in with a password (after a wrong one) and makes a token.
    password = hidden.add("UI password", _secret("pw-"))
    hidden.add("mistyped UI password", password + "x")
    with Session(engine) as session:
        create_user(session=session, username="ops", password=password, role="admin")
        session.commit()
    with TestClient(app, base_url="https://testserver") as ui:
        for attempt, status in ((password + "x", 401), (password, 303)):
            answer = ui.post("/ui/login", follow_redirects=False, data={
                "username": "ops", "password": attempt, "csrf_token": _csrf(ui, "/ui/login")})
            assert answer.status_code == status
        page = ui.post("/ui/tokens", data={"name": "ui-made", "scope": "operator",
                                           "csrf_token": _csrf(ui, "/ui/tokens")})
        [shown] = set(TOKEN.findall(page.text))
        hidden.add("token made in the UI", shown)
        assert ui.get("/ui/deployments/chat").status_code == 200

    logged = everything_logged.text()
    assert "HTTP Request: POST" in logged, "the capture must see httpx's request log"
    assert "delivery of" in logged, "the capture must see the failed deliveries"
    out, err = capfd.readouterr()
    assert hidden.leaks(logged) == [], "secrets in the logs"
    assert hidden.leaks(out + err) == [], "secrets on stdout / stderr"
    # What the API and UI show about hooks' deliveries is logged by the workers too.
    with Session(engine) as session:
        errors = "\n".join(d.error or "" for d in delivery_service.list_deliveries(session=session))
    # Only a status code and a fixed reason: not the receiver's answer.
    assert "HTTP 404" in errors and "Cannot POST" not in errors
    assert hidden.leaks(errors) == [], "secrets in the delivery log"


def test_error_texts_name_no_secret(engine, settings, hidden):
    """Texts that end up in logs when something fails: a store error with the statement's
    parameters, a settings refusal at start-up, the settings' repr."""
    hook_secret = hidden.add("hook secret", _secret("hmac"))
    with Session(engine) as session, pytest.raises(IntegrityError) as failed:
        session.execute(insert(AlertHook).values(
            deployment_id=424242, name="orphan", kind="webhook", url="http://x.example/",
            secret=hook_secret, min_severity="warning", enabled=True, created_by="test"))
        session.flush()
    assert hidden.leaks(str(failed.value)) == []

    short = hidden.add("short secret key", "short" + secrets.token_hex(5))
    with pytest.raises(ValidationError) as refused:
        Settings(database_url=settings.database_url, environment="production",
                 secret_key=short)
    assert "at least 32 characters" in str(refused.value)
    assert hidden.leaks(str(refused.value)) == []
    assert hidden.leaks(repr(settings)) == []
    assert hidden.leaks(str(settings)) == []


# -- a real `exitplane up` --------------------------------------------------------------------

def _cli(args: list[str], env: dict[str, str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exitplane.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120, **kwargs)


@pytest.mark.skipif("postgresql" not in BACKENDS, reason="needs a PostgreSQL URL to put a "
                                                          "password in")
@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_exitplane_up_prints_no_secret(db_url, tmp_path, hidden, receiver):
    port = free_port()
    env = {**os.environ,
           "EXITPLANE_DATABASE_URL": with_password(db_url, hidden.add(
               "database password", _secret("dbpw"))),
           "EXITPLANE_SECRET_KEY": hidden.add("secret key", _secret("sk") * 2),
           "EXITPLANE_ENVIRONMENT": "production", "EXITPLANE_VAR_DIR": str(tmp_path / "var"),
           "EXITPLANE_PORT": str(port), "EXITPLANE_LOG_LEVEL": "debug",
           "EXITPLANE_ACCESS_LOG": "1", "PYTHONUNBUFFERED": "1"}
    printed: list[str] = []

    made = _cli(["token", "create", "--name", "admin", "--scope", "admin"], env)
    assert made.returncode == 0, made.stderr
    admin = {"Authorization": f"Bearer {hidden.add('admin token', made.stdout.strip())}"}
    printed.append(made.stderr)  # stdout is the token, printed once on purpose
    password = hidden.add("UI password", _secret("pw-"))
    password_file = tmp_path / "password"
    password_file.write_text(password + "\n")
    made = _cli(["user", "create", "--username", "ops", "--role", "admin",
                 "--password-file", str(password_file)], env)
    assert made.returncode == 0, made.stderr
    printed += [made.stdout, made.stderr]
    short = hidden.add("short secret key", "short" + secrets.token_hex(5))
    refused = _cli(["db", "upgrade"], {**env, "EXITPLANE_SECRET_KEY": short})
    assert refused.returncode != 0 and "at least 32 characters" in refused.stderr
    printed += [refused.stdout, refused.stderr]

    log_path = tmp_path / "up.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "exitplane.cli", "up", "--no-workers"],
                                  env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        _drive(f"http://127.0.0.1:{port}", server, admin, password, hidden, receiver)
    except AssertionError as failed:
        raise AssertionError(f"{failed}\n{log_path.read_text()[-3000:]}") from None
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    printed.append(log_path.read_text())
    output = "\n".join(printed)
    assert "GET /healthz" in output and "POST /ui/login" in output, output[-2000:]
    assert "store: postgresql+psycopg://postgres:***@" in output
    assert hidden.leaks(output) == [], output[-3000:]


def _drive(base: str, server: subprocess.Popen, admin: dict, password: str, hidden: Secrets,
           receiver: str) -> None:
    """The same flows as in process, over HTTP against the real server."""
    with httpx.Client(base_url=base, timeout=30) as http:
        deadline = time.monotonic() + 90
        while True:
            assert server.poll() is None, "exitplane up exited"
            try:
                if http.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "exitplane up did not answer in 90 s"
            time.sleep(0.3)
        assert http.post("/v1/deployments", headers=admin, json={
            "name": "chat", "model_ref": "m", "num_layers": 12,
            "exit_layers": [3, 6, 9]}).status_code == 201
        assert http.post("/v1/deployments/chat/threshold-sets", headers=admin, json={
            "thresholds": LAYERS, "reason": "first", "activate": True}).status_code == 201
        made = http.post("/v1/tokens", headers=admin, json={
            "name": "rt", "scope": "runtime", "deployment": "chat"})
        runtime = {"Authorization": f"Bearer {hidden.add('runtime token', made.json()['token'])}"}
        assert http.get("/v1/deployments/chat/thresholds", params={"runtime_id": "rt-1"},
                        headers=runtime).status_code == 200
        assert http.post("/v1/deployments/chat/heartbeats", headers=runtime, json={
            "runtime_id": "rt-1", "applied_version": 2}).status_code == 200
        assert http.post("/v1/telemetry", headers=runtime, json=_batch(0)).status_code == 202
        wrong = hidden.add("mistyped token", "ept_" + secrets.token_urlsafe(32))
        assert http.get("/v1/deployments", headers={
            "Authorization": f"Bearer {wrong}"}).status_code == 401
        key = hidden.add("hook URL key", _secret("pathkey"))
        hook_secret = hidden.add("hook HMAC secret", _secret("hmac"))
        hook = http.post("/v1/hooks", headers=admin, json={
            "name": "pager", "kind": "webhook", "url": f"{receiver}/services/{key}?token={key}",
            "secret": hook_secret})
        assert hook.status_code == 201
        assert http.post(f"/v1/hooks/{hook.json()['id']}/test",
                         headers=admin).status_code == 200
        for attempt, status in ((password + "x", 401), (password, 303)):
            page = http.get("/ui/login")
            csrf = CSRF_FIELD.search(page.text).group(1)
            answer = http.post("/ui/login", data={"username": "ops", "password": attempt,
                                                  "csrf_token": csrf})
            assert answer.status_code == status
        hidden.add("mistyped UI password", password + "x")
