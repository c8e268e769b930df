"""OpenID Connect sign-in to the admin UI: the authorization code flow with PKCE (S256).

`OidcClient` reads the provider's discovery document and key set (JWKS), each cached per
process, starts a sign-in (`start`: the authorization URL with a fresh `state`, `nonce` and PKCE
code verifier, which the caller keeps for the callback) and finishes one (`finish`: the code is
exchanged at the token endpoint with the verifier, through Authlib's client, and the ID token is
verified: signature against the provider's keys, with an asymmetric algorithm the provider
announces; `iss`, `aud`, `azp`, `exp`, `iat` and `nonce`). A token without a key id (`kid`) is
checked against the provider's one key of its algorithm, and refused when there are several or
none. A token signed by an unknown key id fetches the key set again (at most once per
KEYS_REFRESH_MIN_S), so a provider's key rotation is followed and a flood of forged tokens
cannot make every callback a JWKS fetch.

Every refusal is `SignInRefused` (an Unauthorized) naming what was wrong; a provider that cannot
be reached or answers nonsense is `Unavailable`.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from dataclasses import dataclass

import httpx
from authlib.integrations.base_client import OAuthError
from authlib.integrations.httpx_client import OAuth2Client
from authlib.oidc.core import CodeIDToken
from joserfc import jwt
from joserfc.errors import (
    BadSignatureError,
    ExpiredTokenError,
    InvalidClaimError,
    InvalidKeyIdError,
    JoseError,
    MissingClaimError,
)
from joserfc.jwk import Key, KeySet, guess_key
from joserfc.jwt import Token

from controlplane.auth.sso import username_of
from controlplane.errors import Unauthorized, Unavailable
from controlplane.settings import Settings, oidc_url_problem

# Signature algorithms an ID token may use: asymmetric only (never `none`, never an HMAC keyed
# by the client secret), intersected with what the provider announces.
ASYMMETRIC_ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256",
                         "ES384", "ES512", "EdDSA")
METADATA_TTL_S = 3600.0
KEYS_TTL_S = 3600.0
KEYS_REFRESH_MIN_S = 30.0
HTTP_TIMEOUT_S = 10.0
# Clock skew tolerated on exp and iat; an ID token issued longer ago than MAX_TOKEN_AGE_S (it
# was minted for this exchange moments ago) is a replay.
LEEWAY_S = 60
MAX_TOKEN_AGE_S = 600
MAX_DOCUMENT_BYTES = 512 * 1024


class SignInRefused(Unauthorized):
    """A single sign-on the control plane refuses; the message says why, for the login page."""


@dataclass(frozen=True)
class OidcConfig:
    """What the control plane knows of its provider and its registration there."""

    issuer: str
    client_id: str
    client_secret: str
    scopes: str
    username_claim: str
    role_claim: str
    display_name: str
    allow_insecure_http: bool

    @classmethod
    def from_settings(cls, settings: Settings) -> OidcConfig | None:
        """The configured provider, or None when EXITPLANE_OIDC_ISSUER is empty."""
        if not settings.oidc_issuer:
            return None
        return cls(issuer=settings.oidc_issuer.rstrip("/"), client_id=settings.oidc_client_id,
                   client_secret=settings.oidc_client_secret.get_secret_value(),
                   scopes=settings.oidc_scopes, username_claim=settings.oidc_username_claim,
                   role_claim=settings.oidc_role_claim,
                   display_name=settings.oidc_display_name,
                   allow_insecure_http=settings.oidc_allow_insecure_http)


@dataclass(frozen=True)
class ProviderMetadata:
    issuer: str
    authorization_endpoint: str
    token_endpoint: str
    jwks_uri: str
    algorithms: tuple[str, ...]


@dataclass(frozen=True)
class SignInStart:
    """Where to send the browser, and what the callback needs back (kept by the caller, out of
    the browser's reach to change: a signed cookie)."""

    url: str
    state: str
    nonce: str
    code_verifier: str


@dataclass(frozen=True)
class VerifiedIdentity:
    """The verified ID token's claims that sign-in uses."""

    subject: str
    username: str
    groups: tuple[str, ...]


class OidcClient:
    """One provider's discovery document and keys, cached for this process, and the two halves
    of a sign-in."""

    def __init__(self, config: OidcConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._metadata: tuple[float, ProviderMetadata] | None = None
        self._keys: tuple[float, KeySet] | None = None

    # -- the provider's documents ---------------------------------------------------------

    def _get_json(self, url: str, what: str) -> dict:
        problem = oidc_url_problem(url, self.config.allow_insecure_http)
        if problem:
            raise Unavailable(f"the identity provider's {what} is unusable: {problem}")
        try:
            response = httpx.get(url, timeout=HTTP_TIMEOUT_S, follow_redirects=False,
                                 headers={"Accept": "application/json"})
        except httpx.HTTPError as error:
            raise Unavailable(f"the identity provider cannot be reached ({type(error).__name__}"
                              f" on its {what}); try again shortly") from None
        if response.status_code != 200 or len(response.content) > MAX_DOCUMENT_BYTES:
            raise Unavailable(f"the identity provider answered {response.status_code} for its "
                              f"{what}; try again shortly")
        try:
            document = response.json()
        except ValueError:
            document = None
        if not isinstance(document, dict):
            raise Unavailable(f"the identity provider's {what} is not a JSON object")
        return document

    def metadata(self) -> ProviderMetadata:
        """The discovery document's endpoints (cached METADATA_TTL_S)."""
        with self._lock:
            if self._metadata and time.monotonic() - self._metadata[0] < METADATA_TTL_S:
                return self._metadata[1]
        document = self._get_json(f"{self.config.issuer}/.well-known/openid-configuration",
                                  "discovery document")
        if str(document.get("issuer", "")).rstrip("/") != self.config.issuer:
            raise Unavailable(f"the discovery document names issuer {document.get('issuer')!r}"
                              f", not the configured {self.config.issuer!r}")
        endpoints = {}
        for name in ("authorization_endpoint", "token_endpoint", "jwks_uri"):
            value = document.get(name)
            problem = oidc_url_problem(value, self.config.allow_insecure_http) \
                if isinstance(value, str) else "missing"
            if problem:
                raise Unavailable(f"the discovery document's {name} is unusable: {problem}")
            endpoints[name] = value
        announced = document.get("id_token_signing_alg_values_supported") or ["RS256"]
        algorithms = tuple(alg for alg in ASYMMETRIC_ALGORITHMS if alg in announced)
        if not algorithms:
            raise Unavailable("the provider signs ID tokens with no asymmetric algorithm "
                              f"exitplane accepts ({', '.join(ASYMMETRIC_ALGORITHMS)})")
        metadata = ProviderMetadata(issuer=document["issuer"], algorithms=algorithms,
                                    **endpoints)
        with self._lock:
            self._metadata = (time.monotonic(), metadata)
        return metadata

    def key_set(self, *, refresh: bool = False) -> KeySet:
        """The provider's public keys (cached KEYS_TTL_S; `refresh` fetches them again unless
        that was done within KEYS_REFRESH_MIN_S)."""
        with self._lock:
            if self._keys:
                age = time.monotonic() - self._keys[0]
                if age < (KEYS_REFRESH_MIN_S if refresh else KEYS_TTL_S):
                    return self._keys[1]
        document = self._get_json(self.metadata().jwks_uri, "key set (JWKS)")
        try:
            keys = KeySet.import_key_set(
                {"keys": [key for key in document.get("keys", [])
                          if isinstance(key, dict) and "d" not in key]})
        except (JoseError, ValueError, TypeError) as error:
            raise Unavailable(f"the provider's key set cannot be read: {error}") from None
        with self._lock:
            self._keys = (time.monotonic(), keys)
        return keys

    # -- a sign-in ---------------------------------------------------------------------------

    def _client(self, redirect_uri: str) -> OAuth2Client:
        return OAuth2Client(
            client_id=self.config.client_id, client_secret=self.config.client_secret or None,
            token_endpoint_auth_method=("client_secret_basic" if self.config.client_secret
                                        else "none"),
            scope=self.config.scopes, redirect_uri=redirect_uri,
            code_challenge_method="S256", timeout=HTTP_TIMEOUT_S)

    def start(self, *, redirect_uri: str) -> SignInStart:
        """A new sign-in: the provider's authorization URL for it and its secrets."""
        state, nonce = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
        code_verifier = secrets.token_urlsafe(48)  # 64 characters of [A-Za-z0-9_-]
        with self._client(redirect_uri) as client:
            url, _ = client.create_authorization_url(
                self.metadata().authorization_endpoint, state=state, nonce=nonce,
                code_verifier=code_verifier)
        return SignInStart(url=url, state=state, nonce=nonce, code_verifier=code_verifier)

    def finish(self, *, code: str, state: str, expected_state: str, nonce: str,
               code_verifier: str, redirect_uri: str) -> VerifiedIdentity:
        """The verified identity behind the provider's answer to the sign-in that expected
        `expected_state`; SignInRefused when anything does not hold."""
        if not state or not hmac.compare_digest(state.encode(), expected_state.encode()):
            raise SignInRefused("the provider's answer does not belong to the sign-in this "
                                "browser started (state mismatch); start again")
        if not code:
            raise SignInRefused("the provider's answer carries no authorization code")
        metadata = self.metadata()
        with self._client(redirect_uri) as client:
            try:
                token = client.fetch_token(metadata.token_endpoint, code=code,
                                           code_verifier=code_verifier,
                                           grant_type="authorization_code")
            except OAuthError as error:
                raise SignInRefused("the provider refused to exchange the authorization code "
                                    f"({error.error}: {error.description or 'no reason given'})"
                                    ) from None
            except httpx.HTTPError as error:
                raise Unavailable("the identity provider's token endpoint cannot be reached "
                                  f"({type(error).__name__}); try again shortly") from None
        id_token = token.get("id_token") if isinstance(token, dict) else None
        if not isinstance(id_token, str):
            raise SignInRefused("the provider's token response carries no ID token (is "
                                "`openid` among the scopes?)")
        claims = self.verify_id_token(id_token, nonce=nonce,
                                      access_token=token.get("access_token"))
        return self.identity(claims)

    def verify_id_token(self, id_token: str, *, nonce: str,
                        access_token: str | None = None) -> dict:
        """The claims of `id_token` once its signature and claims are verified."""
        metadata = self.metadata()
        decoded: Token | None = None
        try:
            try:
                decoded = jwt.decode(id_token, _signing_key(self.key_set()),
                                     algorithms=metadata.algorithms)
            except InvalidKeyIdError:
                decoded = jwt.decode(id_token, _signing_key(self.key_set(refresh=True)),
                                     algorithms=metadata.algorithms)
            claims = CodeIDToken(
                decoded.claims, decoded.header,
                {"iss": {"essential": True, "value": metadata.issuer},
                 "aud": {"essential": True, "value": self.config.client_id},
                 "sub": {"essential": True}},
                {"nonce": nonce, "client_id": self.config.client_id,
                 "access_token": access_token})
            claims.validate(leeway=LEEWAY_S)
        except BadSignatureError:
            raise SignInRefused("the ID token's signature does not verify against the "
                                "provider's keys") from None
        except InvalidKeyIdError:
            raise SignInRefused("the ID token is signed with a key the provider does not "
                                "publish") from None
        except ExpiredTokenError:
            raise SignInRefused("the ID token has expired; sign in again (if this repeats, "
                                "check the clocks of this host and the provider)") from None
        except (InvalidClaimError, MissingClaimError) as error:
            raise SignInRefused(_claim_problem(error, decoded.claims if decoded else {})
                                ) from None
        except (JoseError, ValueError) as error:
            raise SignInRefused(f"the ID token is not valid ({error})") from None
        if claims["iat"] < time.time() - MAX_TOKEN_AGE_S - LEEWAY_S:
            raise SignInRefused("the ID token was issued too long ago to be an answer to this "
                                "sign-in (iat); sign in again")
        return dict(claims)

    def identity(self, claims: dict) -> VerifiedIdentity:
        """The username (the configured claim: an ASCII exitplane username as the provider
        gives it, then lowercased) and groups of verified claims."""
        raw = claims.get(self.config.username_claim)
        if not isinstance(raw, str) or not raw.strip():
            raise SignInRefused(f"the ID token has no {self.config.username_claim!r} claim to "
                                "name the user by (EXITPLANE_OIDC_USERNAME_CLAIM)")
        username = username_of(raw)
        if username is None:
            raise SignInRefused(f"the ID token's {self.config.username_claim!r} claim "
                                f"({raw.strip()[:80]!r}) cannot be an exitplane username (1-64 "
                                "of a-z 0-9 _ . @ -, ASCII only); ask an admin to choose "
                                "another claim (EXITPLANE_OIDC_USERNAME_CLAIM)")
        groups = claims.get(self.config.role_claim, [])
        if isinstance(groups, str):
            groups = [groups]
        if not isinstance(groups, list):
            groups = []
        return VerifiedIdentity(subject=str(claims["sub"]), username=username,
                                groups=tuple(str(group) for group in groups
                                             if isinstance(group, str | int)))


def _signing_key(keys: KeySet):
    """How `jwt.decode` finds the key that signed a token among `keys`: the one its `kid`
    names; a token without a kid, the one key of its algorithm the provider publishes (a
    provider with a single key may leave the kid out), refused when there are none or
    several."""

    def resolve(token) -> Key:
        header = token.headers()
        if header.get("kid") is not None:
            return guess_key(keys, token)
        algorithm = header.get("alg")
        usable = [key for key in keys
                  if key.key_type in KeySet.algorithm_keys.get(algorithm, ())
                  and key.get("use", "sig") == "sig" and key.get("alg", algorithm) == algorithm]
        if len(usable) != 1:
            raise SignInRefused(f"the ID token names no signing key (no `kid` in its header) "
                                f"and the provider publishes {len(usable) or 'no'} "
                                f"{algorithm} key{'' if len(usable) == 1 else 's'}; the provider "
                                "must name the key it signs with")
        return usable[0]

    return resolve


def _claim_problem(error: InvalidClaimError | MissingClaimError, claims: dict) -> str:
    claim = getattr(error, "claim", None) or str(error)
    if "nonce" in claim:
        return "the ID token answers another sign-in (nonce mismatch); start again"
    if "iss" in claim:
        return "the ID token was issued by another issuer than the configured one (iss)"
    if "aud" in claim or "azp" in claim:
        return "the ID token was issued to another client than exitplane's (aud)"
    if "iat" in claim:
        if isinstance(error, MissingClaimError) or "iat" not in claims:
            return "the ID token carries no issue time (iat), which OpenID Connect requires"
        iat = claims["iat"]
        if isinstance(iat, bool) or not isinstance(iat, int | float):
            return f"the ID token's issue time (iat) is not a number of seconds ({iat!r:.40})"
        return "the ID token's issue time (iat) is in the future; check the clocks"
    return f"the ID token's claims do not hold ({error})"


_clients: dict[OidcConfig, OidcClient] = {}
_clients_lock = threading.Lock()


def client_for(settings: Settings) -> OidcClient | None:
    """This process's client of the configured provider (None: OIDC is not configured)."""
    config = OidcConfig.from_settings(settings)
    if config is None:
        return None
    with _clients_lock:
        return _clients.setdefault(config, OidcClient(config))
