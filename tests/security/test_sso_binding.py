"""Single sign-on users belong to the method that created them: a user bound to an OpenID
Connect subject is refused through the trusted proxy's header, and a user the proxy created
(bound to no subject) is refused through OpenID Connect, each with a message that says so.
A username is taken only as ASCII, checked before it is lowercased: the Kelvin sign (U+212A)
lowercases to "k", and "\u212aate" must not sign in as, or create, "kate"."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from controlplane.auth import sso
from controlplane.auth.models import AdminEvent, User
from controlplane.auth.oidc import OidcClient, OidcConfig, SignInRefused
from controlplane.auth.proxy import ProxySignIn
from controlplane.auth.sso import RoleMapping, SsoIdentity, SsoRefused
from controlplane.settings import parse_networks

MAPPING = RoleMapping(groups={"ops": "operator", "ops-admins": "admin"})
ISSUER = "https://idp.example.com"
KELVIN_KATE = "\u212aate"


@pytest.fixture(autouse=True)
def _quick(quick_hashing):
    """Users are created with an unusable hash: no need for its strength here."""


def oidc(username: str, subject: str = "account-1") -> SsoIdentity:
    return SsoIdentity(username=username, groups=("ops",), method="oidc",
                       subject=f"{ISSUER} {subject}")


def proxied(username: str) -> SsoIdentity:
    return SsoIdentity(username=username, groups=("ops",), method="proxy")


def sign_in(session, identity: SsoIdentity) -> User:
    return sso.sign_in(session=session, identity=identity, mapping=MAPPING, address="10.0.0.9")


def test_a_user_bound_to_a_provider_subject_is_refused_through_the_proxy(session):
    sign_in(session, oidc("bob"))
    session.commit()
    with pytest.raises(SsoRefused) as refused:
        sign_in(session, proxied("bob"))
    session.rollback()
    assert "'bob' signs in through the OpenID Connect provider" in str(refused.value)
    assert "the authenticating proxy does not sign in as them" in str(refused.value)
    # The provider's own account still signs in.
    assert sign_in(session, oidc("bob")).sso_subject == f"{ISSUER} account-1"


def test_a_user_the_proxy_created_is_refused_through_openid_connect(session):
    sign_in(session, proxied("carol"))
    session.commit()
    with pytest.raises(SsoRefused) as refused:
        sign_in(session, oidc("carol"))
    session.rollback()
    assert "'carol' signs in through the authenticating proxy" in str(refused.value)
    assert "OpenID Connect does not sign in as them" in str(refused.value)
    carol = session.scalar(select(User).where(User.username == "carol"))
    assert carol.sso_subject is None  # not bound to whoever tried
    assert sign_in(session, proxied("carol")).username == "carol"


def test_a_refusal_is_recorded_as_the_user_it_names(session):
    sign_in(session, oidc("bob"))
    session.commit()
    with pytest.raises(SsoRefused) as refused:
        sign_in(session, proxied("Bob"))
    session.rollback()
    sso.record_refusal(session=session, identity=proxied("Bob"), method="proxy",
                       address="10.0.0.9", reason=str(refused.value))
    session.commit()
    event = session.scalars(select(AdminEvent).where(
        AdminEvent.action == "user.sso_refused")).one()
    assert (event.actor, event.target, event.details["method"]) == ("user:bob", "user:bob",
                                                                     "proxy")
    assert "OpenID Connect provider" in event.reason


@pytest.mark.parametrize("identity", [proxied(KELVIN_KATE), oidc(KELVIN_KATE)],
                         ids=["proxy", "oidc"])
def test_a_non_ascii_name_never_lowercases_into_another(session, identity):
    sign_in(session, proxied("kate"))
    session.commit()
    with pytest.raises(SsoRefused, match="cannot be an exitplane username"):
        sign_in(session, identity)
    session.rollback()
    with pytest.raises(SsoRefused, match="ASCII only"):
        sign_in(session, SsoIdentity(username="\u212aarl", groups=("ops",), method="proxy"))
    session.rollback()
    assert session.scalars(select(User.username)).all() == ["kate"]
    # Recorded without naming kate: the name is kept as given, in the details.
    sso.record_refusal(session=session, identity=identity, method=identity.method,
                       address="10.0.0.9", reason="refused")
    session.commit()
    event = session.scalars(select(AdminEvent).where(
        AdminEvent.action == "user.sso_refused")).one()
    assert (event.actor, event.target) == ("sso:unverified", "address:10.0.0.9")
    assert event.details["username"] == KELVIN_KATE


def test_an_ascii_name_is_lowercased():
    assert sso.username_of("  Alice@Example.com ") == "alice@example.com"
    assert sso.username_of(KELVIN_KATE) is None
    assert sso.username_of("\u0130nci") is None  # dotted capital I
    assert sso.username_of("bob\n") == "bob" and sso.username_of("b ob") is None


def test_the_provider_claim_is_checked_before_it_is_lowercased():
    client = OidcClient(OidcConfig(
        issuer=ISSUER, client_id="exitplane", client_secret="", scopes="openid",
        username_claim="preferred_username", role_claim="groups", display_name="IdP",
        allow_insecure_http=False))
    assert client.identity({"sub": "s", "preferred_username": "Kate"}).username == "kate"
    with pytest.raises(SignInRefused, match="cannot be an exitplane username"):
        client.identity({"sub": "s", "preferred_username": KELVIN_KATE})


def test_the_proxy_header_is_checked_before_it_is_lowercased():
    proxy = ProxySignIn(user_header="x-forwarded-user", groups_header="x-forwarded-groups",
                        trusted=parse_networks("10.0.0.1/32"))
    assert proxy.identity(peer="10.0.0.1", headers={"x-forwarded-user": "Kate"}
                          ).username == "kate"
    kept = proxy.identity(peer="10.0.0.1", headers={"x-forwarded-user": KELVIN_KATE})
    assert kept.username == KELVIN_KATE  # as sent, for sign-in to refuse
