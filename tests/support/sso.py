"""Single sign-on test planes: the API served (uvicorn) with OpenID Connect at the test provider
(tests/support/oidc_provider.py) and header sign-in from 127.0.0.1, the test's own address."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from controlplane.settings import Settings
from exitplane.app import create_app
from tests.support.network import start_server
from tests.support.oidc_provider import OidcProvider

MAPPING = {"ops-admins": "admin", "ops": "operator", "readers": "viewer"}


def sso_settings(db_url: str, tmp_path: Path, issuer: str) -> Settings:
    """OIDC at the test provider (`issuer`) and header sign-in from 127.0.0.1."""
    return Settings(database_url=db_url, var_dir=tmp_path / "var", config_cache_ttl_s=0.2,
                    oidc_issuer=issuer, oidc_client_id="exitplane",
                    oidc_client_secret="provider-test-secret", oidc_allow_insecure_http=True,
                    oidc_display_name="Test IdP", sso_role_mapping=MAPPING,
                    trusted_proxies="127.0.0.1/32", proxy_user_header="X-Forwarded-User",
                    proxy_groups_header="X-Forwarded-Groups")


@contextmanager
def served_api(settings: Settings, engine) -> Iterator[str]:
    """The app on a free port for the block; its base URL."""
    app = create_app(settings, engine=engine)
    live = start_server(app)
    try:
        yield live.url
    finally:
        live.stop()
        app.state.config_delivery.close()
        app.state.heartbeats.close()


@contextmanager
def provider_for(served: str, issuer: str, log: Path) -> Iterator[OidcProvider]:
    """The test provider, sending browsers back to `served`'s callback."""
    started = OidcProvider.start(redirect_uri=f"{served}/ui/login/oidc/callback", log=log,
                                 issuer=issuer)
    try:
        yield started
    finally:
        started.stop()


@contextmanager
def http_browser(served: str) -> Iterator[httpx.Client]:
    """A cookie-keeping client that does not follow redirects (each hop is checked)."""
    with httpx.Client(base_url=served, follow_redirects=False, timeout=30) as client:
        yield client
