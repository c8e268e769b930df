"""The ID token checks that name what is wrong: a token without `iat`, or with one that is not a
number, is refused as such (not as a clock problem); a token whose header names no key (`kid`)
is verified against the provider's one key of its algorithm, and refused, saying it names no
key, when the provider publishes several or none."""

from __future__ import annotations

import time

import pytest
from joserfc import jwt
from joserfc.jwk import ECKey, KeySet, RSAKey

from controlplane.auth.oidc import (
    OidcClient,
    OidcConfig,
    ProviderMetadata,
    SignInRefused,
)

ISSUER = "https://idp.example.com"
NONCE = "nonce-of-this-sign-in"


def _rsa(kid: str | None = None) -> RSAKey:
    parameters = {"use": "sig", "alg": "RS256", **({"kid": kid} if kid else {})}
    return RSAKey.generate_key(2048, parameters=parameters)


@pytest.fixture(scope="module")
def signing_key() -> RSAKey:
    return _rsa("main")


def client_with(*keys) -> OidcClient:
    """A client whose provider documents are already cached: no network."""
    client = OidcClient(OidcConfig(
        issuer=ISSUER, client_id="exitplane", client_secret="s", scopes="openid",
        username_claim="preferred_username", role_claim="groups", display_name="IdP",
        allow_insecure_http=False))
    now = time.monotonic()
    client._metadata = (now, ProviderMetadata(
        issuer=ISSUER, authorization_endpoint=f"{ISSUER}/authorize",
        token_endpoint=f"{ISSUER}/token", jwks_uri=f"{ISSUER}/jwks",
        algorithms=("RS256", "ES256")))
    client._keys = (now, KeySet.import_key_set(
        {"keys": [key.as_dict(private=False) for key in keys]}))
    return client


def id_token(key, *, header: dict | None = None, **overrides) -> str:
    now = int(time.time())
    claims = {"iss": ISSUER, "aud": "exitplane", "sub": "sub-alice", "exp": now + 300,
              "iat": now, "nonce": NONCE, "preferred_username": "alice"}
    claims.update(overrides)
    claims = {name: value for name, value in claims.items() if value is not None}
    return jwt.encode(header or {"alg": "RS256", "kid": key.kid}, claims, key)


@pytest.mark.parametrize(("iat", "says"), [
    (None, "carries no issue time (iat)"),
    ("yesterday", "issue time (iat) is not a number of seconds"),
    (True, "issue time (iat) is not a number of seconds"),
])
def test_a_missing_or_malformed_iat_is_named(signing_key, iat, says):
    client = client_with(signing_key)
    with pytest.raises(SignInRefused, match=r"^the ID token") as refused:
        client.verify_id_token(id_token(signing_key, iat=iat), nonce=NONCE)
    assert says in str(refused.value) and "clocks" not in str(refused.value)


def test_an_iat_in_the_future_is_a_clock_problem(signing_key):
    client = client_with(signing_key)
    with pytest.raises(SignInRefused, match="in the future; check the clocks"):
        client.verify_id_token(id_token(signing_key, iat=int(time.time()) + 3600), nonce=NONCE)


def test_a_token_without_a_kid_verifies_against_the_one_key_of_its_algorithm(signing_key):
    other_kind = ECKey.generate_key("P-256", parameters={"kid": "ec", "use": "sig"})
    encryption = RSAKey.generate_key(2048, parameters={"kid": "enc", "use": "enc"})
    client = client_with(signing_key, other_kind, encryption)
    claims = client.verify_id_token(id_token(signing_key, header={"alg": "RS256"}),
                                    nonce=NONCE)
    assert claims["sub"] == "sub-alice"
    # Signed by a key the provider does not publish: the signature does not verify.
    with pytest.raises(SignInRefused, match="signature does not verify"):
        client.verify_id_token(id_token(_rsa(), header={"alg": "RS256"}), nonce=NONCE)


@pytest.mark.parametrize("published", ["two", "none"])
def test_a_token_without_a_kid_is_refused_when_the_key_is_ambiguous(signing_key, published):
    keys = (signing_key, _rsa("second")) if published == "two" else (
        ECKey.generate_key("P-256", parameters={"kid": "ec"}),)
    client = client_with(*keys)
    with pytest.raises(SignInRefused) as refused:
        client.verify_id_token(id_token(signing_key, header={"alg": "RS256"}), nonce=NONCE)
    says = str(refused.value)
    assert "names no signing key (no `kid` in its header)" in says
    assert ("publishes 2 RS256 keys" if published == "two" else "publishes no RS256 keys") \
        in says
    assert "does not publish" not in says


def test_a_token_naming_an_unknown_kid_is_still_a_key_not_published(signing_key, monkeypatch):
    from controlplane.auth import oidc

    monkeypatch.setattr(oidc, "KEYS_REFRESH_MIN_S", 3600.0)  # no refetch: no network
    client = client_with(signing_key)
    stranger = _rsa("stranger")
    with pytest.raises(SignInRefused, match="a key the provider does not publish"):
        client.verify_id_token(id_token(stranger), nonce=NONCE)
