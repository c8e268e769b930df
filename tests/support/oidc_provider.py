"""A small OpenID Connect provider for the single sign-on tests, built on Authlib's server side
(AuthorizationServer, the authorization code grant, PKCE required, OpenID Connect's ID token):
discovery, JWKS, an authorization endpoint that signs in the configured test user without a
form, and a token endpoint that checks the client secret and the PKCE verifier.

Run as its own process (`OidcProvider.start`: `python -m tests.support.oidc_provider CONFIG`)
on a loopback port. The tests steer it through POST /testing/next (JSON): `username` and
`groups` of the user the next sign-ins approve, `subject` (their `sub`; default
"sub-<username in lowercase>"), and `id_token`: `valid`, `forged` (signed by a
key the JWKS does not hold, under the published key's id), `expired` (issued two hours ago,
expired an hour ago), `wrong_nonce`, or `rotated` (signed by a second key, under its own id,
which the JWKS publishes from then on: a key rotation). GET /testing/requests lists the
authorization and token requests it answered.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar
from urllib.parse import parse_qsl, urlsplit

import httpx
from authlib.common.security import generate_token
from authlib.oauth2 import AuthorizationServer
from authlib.oauth2.rfc6749 import ClientMixin, OAuth2Request
from authlib.oauth2.rfc6749.grants import AuthorizationCodeGrant
from authlib.oauth2.rfc6749.requests import BasicOAuth2Payload
from authlib.oauth2.rfc6750 import BearerTokenGenerator
from authlib.oauth2.rfc7636 import CodeChallenge
from authlib.oidc.core import AuthorizationCodeMixin, UserInfo
from authlib.oidc.core.grants import OpenIDCode
from joserfc.jwk import RSAKey

from tests.support.network import free_port
from tests.support.processes import ROOT, stop_process
from tests.support.waiting import wait_until

KID = "exitplane-test-key"
ROTATED_KID = "exitplane-test-key-2"
CODE_TTL_S = 300


@dataclass
class Steering:
    """What the next sign-ins approve and how their ID tokens are made."""

    username: str = "alice"
    groups: list[str] = field(default_factory=lambda: ["ops-admins"])
    id_token: str = "valid"
    subject: str = ""  # the ID token's `sub`; empty: "sub-" + the username in lowercase


@dataclass
class Client(ClientMixin):
    client_id: str
    client_secret: str
    redirect_uri: str

    def get_client_id(self) -> str:
        return self.client_id

    def get_default_redirect_uri(self) -> str:
        return self.redirect_uri

    def get_allowed_scope(self, scope: str | None) -> str:
        allowed = {"openid", "profile", "email", "groups"}
        return " ".join(s for s in (scope or "").split() if s in allowed)

    def check_redirect_uri(self, redirect_uri: str) -> bool:
        return redirect_uri == self.redirect_uri

    def check_client_secret(self, client_secret: str) -> bool:
        return bool(self.client_secret) and client_secret == self.client_secret

    def check_endpoint_auth_method(self, method: str, endpoint: str) -> bool:
        return method == ("client_secret_basic" if self.client_secret else "none")

    def check_response_type(self, response_type: str) -> bool:
        return response_type == "code"

    def check_grant_type(self, grant_type: str) -> bool:
        return grant_type == "authorization_code"


@dataclass
class AuthorizationCode(AuthorizationCodeMixin):
    code: str
    client_id: str
    redirect_uri: str
    scope: str
    user: Steering
    nonce: str | None
    code_challenge: str | None
    code_challenge_method: str | None
    auth_time: int = field(default_factory=lambda: int(time.time()))

    def get_redirect_uri(self) -> str:
        return self.redirect_uri

    def get_scope(self) -> str:
        return self.scope

    def get_nonce(self) -> str | None:
        return self.nonce

    def get_auth_time(self) -> int:
        return self.auth_time


class Request(OAuth2Request):
    """An HTTP request as Authlib's server reads it."""

    def __init__(self, method: str, uri: str, headers: dict, query: dict, form: dict) -> None:
        super().__init__(method, uri, headers=headers)
        self._args, self._form = query, form
        self.payload = BasicOAuth2Payload({**query, **form})

    @property
    def args(self) -> dict:
        return self._args

    @property
    def form(self) -> dict:
        return self._form


class Provider:
    """The provider's state: its client, signing keys, codes, steering and request log."""

    def __init__(self, *, issuer: str, client: Client) -> None:
        self.issuer, self.client = issuer, client
        self.key = RSAKey.generate_key(2048, parameters={"kid": KID, "use": "sig",
                                                         "alg": "RS256"})
        self.impostor_key = RSAKey.generate_key(2048, parameters={"kid": KID})
        self.rotated_key = RSAKey.generate_key(2048, parameters={
            "kid": ROTATED_KID, "use": "sig", "alg": "RS256"})
        self.rotated = False
        self.codes: dict[str, AuthorizationCode] = {}
        self.steering = Steering()
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.server = self._authorization_server()

    def _authorization_server(self) -> AuthorizationServer:
        provider = self

        class Server(AuthorizationServer):
            def query_client(self, client_id):
                return provider.client if client_id == provider.client.client_id else None

            def save_token(self, token, request):
                """Access tokens are not kept: the provider serves no resources."""

            def create_oauth2_request(self, request):
                return request

            def handle_response(self, status, body, headers):
                return status, body, headers

            def send_signal(self, name, *args, **kwargs):
                """No listeners."""

        class CodeGrant(AuthorizationCodeGrant):
            TOKEN_ENDPOINT_AUTH_METHODS: ClassVar[list[str]] = ["client_secret_basic", "none"]

            def save_authorization_code(self, code, request):
                data = request.payload.data
                with provider.lock:
                    provider.codes[code] = AuthorizationCode(
                        code=code, client_id=request.client.client_id,
                        redirect_uri=request.payload.redirect_uri, scope=request.scope,
                        user=request.user, nonce=data.get("nonce"),
                        code_challenge=data.get("code_challenge"),
                        code_challenge_method=data.get("code_challenge_method"))

            def query_authorization_code(self, code, client):
                with provider.lock:
                    found = provider.codes.get(code)
                if found and found.client_id == client.client_id \
                        and time.time() - found.auth_time < CODE_TTL_S:
                    return found
                return None

            def delete_authorization_code(self, authorization_code):
                with provider.lock:
                    provider.codes.pop(authorization_code.code, None)

            def authenticate_user(self, authorization_code):
                return authorization_code.user

        class IdTokens(OpenIDCode):
            def exists_nonce(self, nonce, request):
                with provider.lock:
                    return any(code.nonce == nonce for code in provider.codes.values())

            def resolve_client_private_key(self, client):
                return {"forged": provider.impostor_key,
                        "rotated": provider.rotated_key}.get(provider.steering.id_token,
                                                             provider.key)

            def get_client_algorithm(self, client):
                return "RS256"

            def get_encode_header(self, client):
                rotated = provider.steering.id_token == "rotated"
                return {"alg": "RS256", "kid": ROTATED_KID if rotated else KID}

            def get_client_claims(self, client):
                claims = {"iss": provider.issuer, "aud": [client.get_client_id()]}
                if provider.steering.id_token == "expired":
                    now = int(time.time())
                    claims.update(iat=now - 7200, exp=now - 3600, auth_time=now - 7200)
                return claims

            def get_authorization_code_claims(self, authorization_code):
                claims = super().get_authorization_code_claims(authorization_code)
                if provider.steering.id_token == "wrong_nonce":
                    claims["nonce"] = "not-the-nonce-exitplane-sent"
                return claims

            def generate_user_info(self, user, scope):
                return UserInfo(sub=user.subject or f"sub-{user.username.lower()}",
                                preferred_username=user.username,
                                email=f"{user.username}@example.com", groups=list(user.groups))

        server = Server()
        server.register_token_generator("default", BearerTokenGenerator(
            lambda *_args, **_kwargs: generate_token(42)))
        server.register_grant(CodeGrant, [CodeChallenge(required=True),
                                          IdTokens(require_nonce=True)])
        return server

    def discovery(self) -> dict:
        return {"issuer": self.issuer, "authorization_endpoint": f"{self.issuer}/authorize",
                "token_endpoint": f"{self.issuer}/token", "jwks_uri": f"{self.issuer}/jwks",
                "response_types_supported": ["code"], "subject_types_supported": ["public"],
                "id_token_signing_alg_values_supported": ["RS256"],
                "code_challenge_methods_supported": ["S256"],
                "scopes_supported": ["openid", "profile", "email", "groups"],
                "token_endpoint_auth_methods_supported": ["client_secret_basic"]}

    def authorize(self, request: Request):
        """Sign the steered user in at once (no form: the test user has approved)."""
        with self.lock:
            user = Steering(**vars(self.steering))
            self.requests.append({"endpoint": "authorize", **request.args})
        grant = self.server.get_authorization_grant(request)
        return self.server.create_authorization_response(request=request, grant_user=user,
                                                         grant=grant)

    def token(self, request: Request):
        with self.lock:
            self.requests.append({"endpoint": "token", **{
                key: value for key, value in request.form.items() if key != "code"}})
        return self.server.create_token_response(request)


def _handler(provider: Provider) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, body, headers=()) -> None:
            payload = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            sent = {name.lower() for name, _ in headers}
            for name, value in headers:
                self.send_header(name, value)
            if "content-type" not in sent:
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def _request(self) -> Request:
            parts = urlsplit(self.path)
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length).decode() if length else ""
            form = dict(parse_qsl(body)) if "form" in (self.headers.get("content-type") or "") \
                else {}
            return Request(self.command, f"{provider.issuer}{self.path}", dict(self.headers),
                           dict(parse_qsl(parts.query)), form)

        def do_GET(self) -> None:
            path = urlsplit(self.path).path
            if path == "/.well-known/openid-configuration":
                self._send(200, provider.discovery())
            elif path == "/jwks":
                with provider.lock:
                    keys = [provider.key] + ([provider.rotated_key] if provider.rotated else [])
                self._send(200, {"keys": [key.as_dict(private=False) for key in keys]})
            elif path == "/authorize":
                self._send(*provider.authorize(self._request()))
            elif path == "/testing/requests":
                with provider.lock:
                    self._send(200, list(provider.requests))
            else:
                self._send(404, {"error": "not_found"})

        def do_POST(self) -> None:
            path = urlsplit(self.path).path
            if path == "/token":
                self._send(*provider.token(self._request()))
            elif path == "/testing/next":
                length = int(self.headers.get("content-length") or 0)
                with provider.lock:
                    provider.steering = Steering(**json.loads(self.rfile.read(length)))
                    provider.rotated |= provider.steering.id_token == "rotated"
                self._send(200, vars(provider.steering))
            else:
                self._send(404, {"error": "not_found"})

        def log_message(self, *_args) -> None:
            """Quiet: the tests read /testing/requests."""

    return Handler


def issuer_url() -> str:
    """An issuer URL on a free loopback port."""
    return f"http://127.0.0.1:{free_port()}"


class OidcProvider:
    """The provider in a process of its own on a loopback port (started by `start`)."""

    def __init__(self, process: subprocess.Popen, issuer: str, client: Client,
                 log: Path) -> None:
        self.process, self.issuer, self.client, self.log = process, issuer, client, log

    @classmethod
    def start(cls, *, redirect_uri: str, log: Path, issuer: str | None = None,
              client_id: str = "exitplane",
              client_secret: str = "provider-test-secret") -> OidcProvider:
        """Start it at `issuer` (`issuer_url()`'s, chosen before the app that trusts it is
        made) and wait until its discovery document answers."""
        issuer = issuer or issuer_url()
        client = Client(client_id=client_id, client_secret=client_secret,
                        redirect_uri=redirect_uri)
        config = json.dumps({"issuer": issuer, **vars(client)})
        with log.open("w") as out:
            process = subprocess.Popen([sys.executable, "-m", "tests.support.oidc_provider",
                                        config], cwd=ROOT, stdout=out,
                                       stderr=subprocess.STDOUT)
        provider = cls(process, issuer, client, log)

        def ready() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"the OIDC provider exited:\n{log.read_text()}")
            try:
                return httpx.get(f"{issuer}/.well-known/openid-configuration",
                                 timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(ready, 30, "the OIDC provider to answer")
        return provider

    def steer(self, *, username: str = "alice", groups: list[str] | None = None,
              id_token: str = "valid", subject: str = "") -> None:
        """What the next sign-ins approve (see the module's docstring)."""
        httpx.post(f"{self.issuer}/testing/next", timeout=10, json={
            "username": username, "groups": ["ops-admins"] if groups is None else groups,
            "id_token": id_token, "subject": subject}).raise_for_status()

    def requests(self) -> list[dict]:
        return httpx.get(f"{self.issuer}/testing/requests", timeout=10).json()

    def stop(self) -> None:
        stop_process(self.process, timeout=10)


def main(argv: list[str]) -> None:
    config = json.loads(argv[0])
    provider = Provider(issuer=config["issuer"], client=Client(
        client_id=config["client_id"], client_secret=config["client_secret"],
        redirect_uri=config["redirect_uri"]))
    port = urlsplit(config["issuer"]).port
    ThreadingHTTPServer(("127.0.0.1", port), _handler(provider)).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
