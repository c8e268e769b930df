"""No server-side request forgery through alert hooks.

An admin (or whoever holds an admin token) must not be able to point a hook at the database,
the cloud metadata service or Redis and read the answer in the delivery log: destinations are
resolved and refused unless public or allow-listed (EXITPLANE_HOOK_ALLOWED_HOSTS), at creation
and again at delivery; the connection goes to the address that was checked; redirects are not
followed; a failed delivery keeps only its status code and a fixed reason."""

from __future__ import annotations

import datetime
import socket
import ssl
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from sqlalchemy.orm import Session

from controlplane.alerts import delivery_service, hook_service, hooks
from controlplane.alerts.guard import AllowList, HookGuard
from controlplane.keys import vault
from controlplane.settings import Settings
from tests.support.alerts import make_deployment
from tests.support.network import free_port, serve_in_thread
from tests.support.waiting import patient_get

BASE = "http://exitplane.test"
INWARD = [
    "http://127.0.0.1:5432/",  # the store
    "http://169.254.169.254/latest/meta-data/iam/security-credentials/",  # cloud metadata
    "http://redis:6379/",  # a compose / cluster service name
    "http://postgres.default.svc.cluster.local:5432/",
    "http://metadata.google.internal/computeMetadata/v1/",
    "http://10.0.0.7:9200/", "http://192.168.1.1/", "http://172.16.0.1/",
    "http://100.64.0.1/",  # CGNAT
    "http://[::1]:6379/", "http://[fd00::1]/", "http://[::ffff:127.0.0.1]:5432/",
    "http://0.0.0.0:8000/", "http://224.0.0.1/", "http://localhost:8000/metrics",
    "http://points-home.example.com:5432/",  # a public-looking name resolving to loopback
]


@pytest.fixture
def resolving(monkeypatch):
    """Names this test's DNS answers (the others go to the real resolver)."""
    answers: dict[str, list[str]] = {"points-home.example.com": ["127.0.0.1"]}
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        if isinstance(host, str) and host in answers:
            queue = answers[host]
            address = queue.pop(0) if len(queue) > 1 else queue[0]
            return real(address, port, *args, **kwargs)
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return answers


@pytest.fixture
def settings(db_url, tmp_path):
    """No allow-list: the shipped default."""
    return Settings(database_url=db_url, var_dir=tmp_path / "var", hook_allowed_hosts="")


class Server:
    """A real HTTP server on `host`, answering `status` with `body` (and `headers`); HTTPS
    when given a server-side `tls` context."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, status: int = 200,
                 body: bytes = b"ok", headers: dict[str, str] | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        self.requests: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                server.requests.append({"path": self.path, "headers": dict(self.headers),
                                        "body": self.rfile.read(length)})
                self.send_response(status)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.http = ThreadingHTTPServer((host, port), Handler)
        if tls is not None:
            self.http.socket = tls.wrap_socket(self.http.socket, server_side=True)
        self.port = self.http.server_address[1]
        serve_in_thread(self.http)

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.mark.parametrize("url", INWARD)
def test_hooks_to_internal_destinations_are_refused_at_creation(client, tokens, url, resolving):
    admin = tokens.headers(tokens.admin)
    created = client.post("/v1/hooks", headers=admin,
                          json={"name": "probe", "kind": "webhook", "url": url})
    assert created.status_code == 422, created.text
    detail = created.json()["detail"]
    assert "EXITPLANE_HOOK_ALLOWED_HOSTS" in detail
    assert client.get("/v1/hooks", headers=admin).json() == []


def test_the_allow_list_admits_hosts_addresses_and_networks(client, tokens, app):
    app.state.settings = app.state.settings.model_copy(update={
        "hook_allowed_hosts": "127.0.0.1, 10.0.0.0/8,redis,[::1]"})
    admin = tokens.headers(tokens.admin)
    for url in ("http://127.0.0.1:5432/", "http://10.0.0.7:9200/", "http://redis:6379/",
                "http://[::1]:6379/"):
        created = client.post("/v1/hooks", headers=admin,
                              json={"name": "local", "kind": "webhook", "url": url})
        assert created.status_code == 201, (url, created.text)
    refused = client.post("/v1/hooks", headers=admin, json={
        "name": "metadata", "kind": "webhook", "url": "http://169.254.169.254/"})
    assert refused.status_code == 422


def test_changing_a_hook_url_is_checked_too(client, tokens):
    admin = tokens.headers(tokens.admin)
    hook_id = client.post("/v1/hooks", headers=admin, json={
        "name": "n", "kind": "webhook", "url": "https://receiver.example.com/in"}).json()["id"]
    moved = client.patch(f"/v1/hooks/{hook_id}", headers=admin,
                         json={"url": "http://169.254.169.254/latest/meta-data/"})
    assert moved.status_code == 422 and "link-local" in moved.json()["detail"]
    shown = client.get(f"/v1/hooks/{hook_id}", headers=admin).json()
    assert shown["url"] == "https://receiver.example.com/…"


def test_slack_and_pagerduty_hooks_stay_on_their_official_hosts(client, tokens):
    admin = tokens.headers(tokens.admin)

    def create(kind: str, url: str) -> int:
        return client.post("/v1/hooks", headers=admin, json={
            "name": kind, "kind": kind, "url": url, "routing_key": "R0UTINGKEY"}).status_code

    assert create("slack", "https://hooks.slack.com.evil.example/services/T/B/X") == 422
    assert create("slack", "http://hooks.slack.com/services/T/B/X") == 422  # not https
    assert create("pagerduty", "https://events.pagerduty.example/v2/enqueue") == 422
    assert create("slack", "https://hooks.slack.com/services/T0/B0/XYZ") == 201
    assert create("pagerduty", "https://events.pagerduty.com/v2/enqueue") == 201
    assert create("pagerduty", "https://events.eu.pagerduty.com/v2/enqueue") == 201


def test_a_name_that_turns_inward_after_creation_is_refused_at_delivery(session: Session,
                                                                        resolving):
    internal = Server()
    try:
        url = f"http://turncoat.example.com:{internal.port}/hook"
        resolving["turncoat.example.com"] = ["93.184.216.34"]  # public when the hook is made
        guard = HookGuard(vault=vault(Settings()), allowed=AllowList())
        deployment = make_deployment(session)
        hook = hook_service.create_hook(session=session, name="x", kind="webhook", url=url,
                                        actor="test", deployment=deployment, guard=guard)
        resolving["turncoat.example.com"] = ["127.0.0.1"]  # and points at us afterwards
        delivery = delivery_service.send_test_alert(session=session, hook=hook, base_url=BASE,
                                                    actor="test", timeout_s=5, guard=guard)
        assert not delivery.ok and delivery.status_code is None
        assert delivery.error.startswith("destination refused") and "loopback" in delivery.error
        assert not delivery_service.is_retryable(delivery)  # the workers do not keep knocking
        assert internal.requests == []
        # A name DNS does not answer for is accepted when made, and retried when delivered.
        lost = hook_service.create_hook(session=session, name="y", kind="webhook", actor="test",
                                        url="https://nowhere.invalid/hook", deployment=deployment,
                                        guard=guard)
        unresolved = delivery_service.send_test_alert(session=session, hook=lost, base_url=BASE,
                                                      actor="test", timeout_s=5, guard=guard)
        assert unresolved.error.startswith("destination unresolved")
        assert delivery_service.is_retryable(unresolved)
    finally:
        internal.stop()


def test_a_rebinding_resolver_cannot_switch_the_connection(session: Session, resolving):
    """DNS answers the allow-listed 127.0.0.2 when the destination is checked, then 127.0.0.1:
    the connection still goes to 127.0.0.2, with the hook's own host name in Host."""
    port = free_port()
    vetted = Server(host="127.0.0.2", port=port)
    other = Server(host="127.0.0.1", port=port)
    try:
        guard = HookGuard(vault=vault(Settings()), allowed=AllowList.parse("127.0.0.2"))
        deployment = make_deployment(session)
        hook = hook_service.create_hook(session=session, name="x", kind="webhook", actor="test",
                                        url=f"http://rebind.example.com:{port}/hook",
                                        deployment=deployment, guard=guard)
        resolving["rebind.example.com"] = ["127.0.0.2", "127.0.0.1"]
        delivery = delivery_service.send_test_alert(session=session, hook=hook, base_url=BASE,
                                                    actor="test", timeout_s=5, guard=guard)
        assert delivery.ok, delivery.error
        assert other.requests == []
        [request] = vetted.requests
        assert request["headers"]["Host"] == f"rebind.example.com:{port}"
        assert request["path"] == "/hook"
    finally:
        vetted.stop()
        other.stop()


def _certificate(tmp_path, name: str) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server context, client context trusting only it) for a self-signed certificate of
    DNS name `name` (no IP address in it)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(hours=1))
                   .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]),
                                  critical=False)
                   .add_extension(x509.BasicConstraints(ca=True, path_length=None),
                                  critical=True)
                   .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert_path, key_path)
    client = ssl.create_default_context(cafile=str(cert_path))
    return server, client


def test_a_pinned_https_connection_still_verifies_the_hook_host_name(session: Session,
                                                                     resolving, tmp_path):
    """Connecting to the vetted address keeps TLS honest: SNI and the certificate check use
    the hook's host name (the certificate names no address, so a check against the address
    would fail), and a certificate for another name is refused."""
    server_tls, client_tls = _certificate(tmp_path, "pinned.example.com")
    port = free_port()
    vetted = Server(host="127.0.0.2", port=port, tls=server_tls)
    other = Server(host="127.0.0.1", port=port)
    try:
        guard = HookGuard(vault=vault(Settings()), allowed=AllowList.parse("127.0.0.2"),
                          tls_verify=client_tls)
        deployment = make_deployment(session)
        hook = hook_service.create_hook(session=session, name="x", kind="webhook", actor="test",
                                        url=f"https://pinned.example.com:{port}/hook",
                                        deployment=deployment, guard=guard)
        resolving["pinned.example.com"] = ["127.0.0.2", "127.0.0.1"]
        delivery = delivery_service.send_test_alert(session=session, hook=hook, base_url=BASE,
                                                    actor="test", timeout_s=5, guard=guard)
        assert delivery.ok, delivery.error
        assert len(vetted.requests) == 1 and other.requests == []
        assert vetted.requests[0]["headers"]["Host"] == f"pinned.example.com:{port}"

        resolving["impostor.example.com"] = ["127.0.0.2"]
        impostor = hook_service.create_hook(session=session, name="y", kind="webhook", actor="test",
                                            url=f"https://impostor.example.com:{port}/hook",
                                            deployment=deployment, guard=guard)
        refused = delivery_service.send_test_alert(session=session, hook=impostor, base_url=BASE,
                                                   actor="test", timeout_s=5, guard=guard)
        assert not refused.ok and refused.error == hooks.NO_ANSWER
        assert len(vetted.requests) == 1
    finally:
        vetted.stop()
        other.stop()


def test_deliveries_store_no_response_text_and_follow_no_redirect(client, tokens, app):
    app.state.settings = app.state.settings.model_copy(update={"hook_allowed_hosts":
                                                               "127.0.0.1"})
    admin = tokens.headers(tokens.admin)
    leaky = Server(status=500, body=b"FATAL: password authentication failed for user postgres")
    moved = Server(status=302, body=b"see elsewhere",
                   headers={"Location": "http://169.254.169.254/latest/meta-data/"})
    closed = f"http://127.0.0.1:{free_port()}/"
    try:
        errors = []
        for url in (f"http://127.0.0.1:{leaky.port}/", f"http://127.0.0.1:{moved.port}/",
                    closed):
            hook_id = client.post("/v1/hooks", headers=admin, json={
                "name": "n", "kind": "webhook", "url": url}).json()["id"]
            sent = client.post(f"/v1/hooks/{hook_id}/test", headers=admin).json()
            assert not sent["ok"]
            logged = patient_get(client, f"/v1/hooks/{hook_id}/deliveries", headers=admin).json()
            assert [entry["error"] for entry in logged] == [sent["error"]]
            errors.append(sent["error"])
        assert errors == ["HTTP 500", f"HTTP 302: {hooks.REDIRECT_REFUSED}", hooks.NO_ANSWER]
        assert len(leaky.requests) == 1 and len(moved.requests) == 1
    finally:
        leaky.stop()
        moved.stop()


@pytest.mark.parametrize("entry", ["10.0.0.0/33", "hooks example", "http://10.0.0.1/"])
def test_a_malformed_allow_list_refuses_to_start(entry):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="EXITPLANE_HOOK_ALLOWED_HOSTS"):
        Settings(hook_allowed_hosts=f"127.0.0.1,{entry}")
    parsed = AllowList.parse(Settings(hook_allowed_hosts="Alertmanager., 10.0.0.0/8,::1")
                             .hook_allowed_hosts)
    assert parsed.names == {"alertmanager"} and len(parsed.networks) == 2
