"""The client's HTTP options reach the wire on every request it makes (pulls, long-polls,
telemetry, heartbeats, leave): a CA bundle and a client certificate against a control plane
served over TLS that requires one; a proxy that sees and forwards every request with the extra
headers and the User-Agent; a transport of the caller's, shared by the parts and left open for
the leave message. Options that cannot work together, or files that cannot be loaded, are
refused with what to do."""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import ssl
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import metadata
from urllib.parse import urlsplit

import httpx
import pytest
import uvicorn

from exitplane.client import Runtime
from exitplane.client.http import USER_AGENT, http_client
from tests.support.network import free_port, serve_in_thread
from tests.support.runtime_link import DEPLOYMENT, EXIT_LAYERS, NUM_LAYERS, publish
from tests.support.waiting import wait_until

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: E402

FAST = {"long_poll_s": 0.5, "heartbeat_interval_s": 0.3, "backoff_initial_s": 0.05,
        "backoff_max_s": 0.3}
SHIP_FAST = {"batch_interval_s": 0.05, "backoff_initial_s": 0.05, "backoff_max_s": 0.2,
             "fsync": False}
FLEET = f"/v1/deployments/{DEPLOYMENT}/runtimes"


# -- a certificate authority, a server certificate and a client certificate ---------------
def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _issue(subject: str, key, issuer_name: x509.Name, issuer_key, *, ca: bool,
           usage: list | None = None, names: list | None = None):
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                              critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                   issuer_key.public_key()), critical=False)
               .add_extension(x509.KeyUsage(
                   digital_signature=not ca, content_commitment=False, key_encipherment=False,
                   data_encipherment=False, key_agreement=False, key_cert_sign=ca,
                   crl_sign=ca, encipher_only=False, decipher_only=False), critical=True))
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path, certificate, key=None) -> str:
    pem = certificate.public_bytes(serialization.Encoding.PEM)
    if key is not None:
        pem += key.private_bytes(serialization.Encoding.PEM,
                                 serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())
    path.write_bytes(pem)
    return str(path)


@pytest.fixture
def pki(tmp_path) -> dict[str, str]:
    """PEM files: `ca`, `server` (certificate and key, for 127.0.0.1), `client_cert` and
    `client_key` (a client certificate the CA signed), `stranger` (one it did not)."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _issue("exitplane test CA", ca_key, _name("exitplane test CA"), ca_key, ca=True)
    files = {"ca": _write(tmp_path / "ca.pem", ca)}
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = _issue("127.0.0.1", server_key, ca.subject, ca_key, ca=False,
                    usage=[ExtendedKeyUsageOID.SERVER_AUTH],
                    names=[x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                           x509.DNSName("localhost")])
    files["server"] = _write(tmp_path / "server.pem", server, server_key)
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = _issue("pod-1", client_key, ca.subject, ca_key, ca=False,
                    usage=[ExtendedKeyUsageOID.CLIENT_AUTH])
    files["client_cert"] = _write(tmp_path / "client.pem", client)
    files["client_key"] = str(tmp_path / "client.key")
    (tmp_path / "client.key").write_bytes(client_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    stranger_key = ec.generate_private_key(ec.SECP256R1())
    stranger = _issue("stranger", stranger_key, _name("stranger"), stranger_key, ca=False,
                      usage=[ExtendedKeyUsageOID.CLIENT_AUTH])
    files["stranger"] = _write(tmp_path / "stranger.pem", stranger, stranger_key)
    return files


@pytest.fixture
def tls_control_plane(app, pki):
    """The control plane's app over TLS on a free port, requiring a client certificate the
    test CA signed; yields its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(
        app, host="127.0.0.1", port=port, lifespan="off", log_level="warning",
        ssl_certfile=pki["server"], ssl_ca_certs=pki["ca"], ssl_cert_reqs=ssl.CERT_REQUIRED,
        timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), message="uvicorn over TLS")
    assert server.started
    yield f"https://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=15)


def _record_tokens(rt, count: int) -> None:
    for position in range(count):
        assert rt.record(request_id="opt", position=position, exit_layer=2, signal_value=0.95)


@pytest.mark.slow  # a control plane over TLS, seconds of polling
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_ca_bundle_and_a_client_certificate_carry_every_request(
        tls_control_plane, operator, runtime_token, pki, tmp_path):
    first = publish(operator, {2: 0.9, 4: 0.9})
    errors: list[str] = []
    rt = Runtime(url=tls_control_plane, token=runtime_token, deployment=DEPLOYMENT,
                 runtime_id="tls-1", num_layers=NUM_LAYERS, exit_layers=EXIT_LAYERS,
                 state_dir=tmp_path / "state", threshold_options=FAST,
                 shipper_options=SHIP_FAST, verify=pki["ca"],
                 cert=(pki["client_cert"], pki["client_key"]))
    rt.on_error(errors.append)
    with rt:
        assert rt.version == first and not rt.thresholds.degraded  # the pull
        second = publish(operator, {2: 0.8, 4: 0.8})
        wait_until(lambda: rt.version == second, message="the long-poll over TLS")
        _record_tokens(rt, 20)
        assert rt.flush(10) and rt.metrics["telemetry_sent_records"] == 20  # telemetry
        wait_until(lambda: rt.metrics["thresholds_heartbeats"] >= 2, message="heartbeats")
        assert [r["runtime_id"] for r in operator.get(FLEET).json()] == ["tls-1"]
    assert operator.get(FLEET).json() == [] and errors == []  # the leave


@pytest.mark.slow  # a control plane over TLS
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_from_env_reads_the_ca_bundle_the_client_certificate_and_the_proxy(
        tls_control_plane, operator, runtime_token, pki, tmp_path, monkeypatch):
    first = publish(operator, {2: 0.9, 4: 0.9})
    for name, value in {"URL": tls_control_plane, "TOKEN": runtime_token,
                        "DEPLOYMENT": DEPLOYMENT, "RUNTIME_ID": "env-tls-1",
                        "NUM_LAYERS": str(NUM_LAYERS),
                        "EXIT_LAYERS": ",".join(map(str, EXIT_LAYERS)),
                        "STATE_DIR": str(tmp_path / "state"), "CA_BUNDLE": pki["ca"],
                        "CLIENT_CERT": pki["client_cert"],
                        "CLIENT_KEY": pki["client_key"]}.items():
        monkeypatch.setenv(f"EXITPLANE_{name}", str(value))
    with Runtime.from_env(threshold_options=FAST, shipper_options=SHIP_FAST) as rt:
        assert rt.version == first and not rt.thresholds.degraded
    monkeypatch.delenv("EXITPLANE_CLIENT_CERT")
    with pytest.raises(ValueError, match="EXITPLANE_CLIENT_KEY needs EXITPLANE_CLIENT_CERT"):
        Runtime.from_env()
    monkeypatch.delenv("EXITPLANE_CLIENT_KEY")
    monkeypatch.setenv("EXITPLANE_PROXY", "ftp://proxy.invalid")
    with pytest.raises(ValueError):  # the proxy URL is checked as the keyword's is
        Runtime.from_env()


@pytest.mark.slow  # a control plane over TLS
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_tls_server_refuses_what_the_options_leave_out(tls_control_plane, pki):
    path = f"/v1/deployments/{DEPLOYMENT}/thresholds"
    with http_client(base_url=tls_control_plane, token="t", timeout=5, verify=pki["ca"],
                     cert=(pki["client_cert"], pki["client_key"])) as trusted:
        assert trusted.get(path).status_code == 401  # through TLS: the token is refused
    with http_client(base_url=tls_control_plane, token="t", timeout=5) as default_trust, \
            pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        default_trust.get(path)  # the test CA is not in the system's trust
    for cert in (None, pki["stranger"]):  # no client certificate, or one the CA did not sign
        with http_client(base_url=tls_control_plane, token="t", timeout=5, verify=pki["ca"],
                         cert=cert) as untrusted, pytest.raises(httpx.TransportError):
            untrusted.get(path)
    context = ssl.create_default_context(cafile=pki["ca"])
    context.load_cert_chain(pki["client_cert"], pki["client_key"])
    with http_client(base_url=tls_control_plane, token="t", timeout=5,
                     verify=context) as own_context:
        assert own_context.get(path).status_code == 401


# -- a forward proxy that records what passes through it -------------------------------------
HOP_BY_HOP = {"connection", "proxy-connection", "keep-alive", "transfer-encoding", "te",
              "upgrade", "proxy-authorization"}


class RecordingProxy(BaseHTTPRequestHandler):
    """Forwards absolute-form requests to their origin; records (method, path, headers)."""

    def _forward(self) -> None:
        target = urlsplit(self.path)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        headers = {name: value for name, value in self.headers.items()
                   if name.lower() not in HOP_BY_HOP}
        with self.server.lock:
            self.server.seen.append((self.command, target.path,
                                     {k.lower(): v for k, v in headers.items()}))
        origin = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
        try:
            origin.request(self.command, target.path + (f"?{target.query}" if target.query
                                                        else ""), body=body, headers=headers)
            answer = origin.getresponse()
            content = answer.read()
        finally:
            origin.close()
        self.send_response(answer.status)
        for name, value in answer.getheaders():
            if name.lower() not in HOP_BY_HOP | {"content-length"}:
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(content)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(content)

    do_GET = do_POST = _forward

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def recording_proxy():
    server = ThreadingHTTPServer(("127.0.0.1", 0), RecordingProxy)
    server.daemon_threads = True
    server.lock, server.seen = threading.Lock(), []
    serve_in_thread(server)
    yield server
    server.shutdown()
    server.server_close()


def test_the_user_agent_names_the_client_and_its_python():
    version = metadata.version("exitplane-client")
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert f"exitplane-client/{version} (python {python})" == USER_AGENT


@pytest.mark.slow  # a control plane, seconds of polling
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_proxy_sees_every_request_with_the_headers_and_the_user_agent(
        control_plane, operator, runtime_token, recording_proxy, tmp_path):
    first = publish(operator, {2: 0.9, 4: 0.9})
    proxy_url = f"http://127.0.0.1:{recording_proxy.server_address[1]}"
    errors: list[str] = []
    with Runtime(url=control_plane.url, token=runtime_token, deployment=DEPLOYMENT,
                 runtime_id="proxied-1", num_layers=NUM_LAYERS, exit_layers=EXIT_LAYERS,
                 state_dir=tmp_path / "state", threshold_options=FAST,
                 shipper_options=SHIP_FAST, proxy=proxy_url,
                 headers={"X-Fleet": "blue", "User-Agent": "pod-agent/2"}) as rt:
        rt.on_error(errors.append)
        assert rt.version == first
        _record_tokens(rt, 10)
        assert rt.flush(10) and rt.metrics["telemetry_sent_records"] == 10
        wait_until(lambda: rt.metrics["thresholds_heartbeats"] >= 2, message="heartbeats")
        wait_until(lambda: rt.metrics["thresholds_not_modified"] >= 1, message="a long-poll")
    assert operator.get(FLEET).json() == [] and errors == []

    with recording_proxy.lock:
        seen = list(recording_proxy.seen)
    kinds = {(method, path.rsplit("/", 1)[-1]) for method, path, _ in seen}
    assert kinds == {("GET", "thresholds"), ("POST", "heartbeats"), ("POST", "telemetry"),
                     ("POST", "leave")}
    for _, _, headers in seen:
        assert headers["x-fleet"] == "blue"
        assert headers["user-agent"] == f"pod-agent/2 {USER_AGENT}"
        assert headers["authorization"] == f"Bearer {runtime_token}"


class RecordingTransport(httpx.BaseTransport):
    """httpx's own transport, recording each request and whether it is closed."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.seen: list[tuple[str, str, str]] = []
        self.closed = False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        assert not self.closed, "a request on a closed transport"
        self.seen.append((request.method, request.url.path.rsplit("/", 1)[-1],
                          request.headers["user-agent"]))
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.closed = True
        self.inner.close()


@pytest.mark.slow  # a control plane, seconds of polling
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_transport_carries_every_request_and_stays_open_until_its_owner_closes_it(
        control_plane, operator, runtime_token, tmp_path):
    publish(operator, {2: 0.9, 4: 0.9})
    transport = RecordingTransport()
    with Runtime(url=control_plane.url, token=runtime_token, deployment=DEPLOYMENT,
                 runtime_id="transported-1", num_layers=NUM_LAYERS, exit_layers=EXIT_LAYERS,
                 state_dir=tmp_path / "state", threshold_options=FAST,
                 shipper_options=SHIP_FAST, transport=transport) as rt:
        _record_tokens(rt, 5)
        assert rt.flush(10)
    assert not transport.closed
    transport.close()
    assert operator.get(FLEET).json() == []
    assert {(method, kind) for method, kind, _ in transport.seen} == {
        ("GET", "thresholds"), ("POST", "heartbeats"), ("POST", "telemetry"),
        ("POST", "leave")}
    assert {agent for _, _, agent in transport.seen} == {USER_AGENT}


def test_options_that_cannot_work_are_refused_with_what_to_do(tmp_path):
    common = {"deployment": DEPLOYMENT, "runtime_id": "refused-1", "num_layers": NUM_LAYERS,
              "exit_layers": EXIT_LAYERS, "url": "https://control-plane.invalid",
              "token": "t", "state_dir": tmp_path / "state"}
    with pytest.raises(ValueError, match=r"Authorization.*token or token_file"):
        Runtime(**common, headers={"authorization": "Bearer other"})
    with pytest.raises(ValueError, match="transport replaces"):
        Runtime(**common, transport=httpx.HTTPTransport(), proxy="http://127.0.0.1:3128")
    with pytest.raises(ValueError, match=r"cannot load the CA bundle .*missing\.pem"):
        Runtime(**common, verify=str(tmp_path / "missing.pem"))
    (tmp_path / "not-a-cert.pem").write_text("not a certificate")
    with pytest.raises(ValueError, match="cannot load the client certificate"):
        Runtime(**common, cert=str(tmp_path / "not-a-cert.pem"))
    with pytest.raises(ValueError, match="load_cert_chain"):
        Runtime(**common, verify=ssl.create_default_context(), cert="client.pem")
    with pytest.raises(TypeError, match="verfy"):
        http_client(base_url="http://127.0.0.1:9", token="t", timeout=1, verfy=False)

