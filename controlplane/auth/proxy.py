"""Sign-in by header behind a trusted authenticating proxy (oauth2-proxy, an ingress with
external authentication, ...).

The proxy authenticates the person and names them in EXITPLANE_PROXY_USER_HEADER (their groups
in EXITPLANE_PROXY_GROUPS_HEADER, comma-separated: a group name cannot hold a comma, and each
is compared with the role mapping exactly as sent, case and inner spaces included). The header
is believed only when the connection itself comes from an address in EXITPLANE_TRUSTED_PROXIES:
the socket's peer, never X-Forwarded-For or anything else the request says about itself. From
any other peer the header is ignored, and logged without its value (a client can write
anything there).
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass

from controlplane.auth.sso import SsoIdentity, username_of
from controlplane.settings import Network, Settings, parse_networks

log = logging.getLogger("exitplane.auth")

# Bounds on what a header may carry: a username of USERNAME_PATTERN's length, groups that fit
# in an ordinary header.
MAX_USER_CHARS = 200
MAX_GROUPS_CHARS = 8192
MAX_GROUPS = 256


@dataclass(frozen=True)
class ProxySignIn:
    """The header sign-in's configuration: the headers (lowercase) and the trusted peers."""

    user_header: str
    groups_header: str
    trusted: tuple[Network, ...]

    @classmethod
    def from_settings(cls, settings: Settings) -> ProxySignIn | None:
        """The configured header sign-in, or None when EXITPLANE_PROXY_USER_HEADER is empty."""
        if not settings.proxy_user_header:
            return None
        return cls(user_header=settings.proxy_user_header.lower(),
                   groups_header=settings.proxy_groups_header.lower(),
                   trusted=parse_networks(settings.trusted_proxies))

    def peer_trusted(self, peer: str) -> bool:
        """Whether the connection's own peer address is a trusted proxy."""
        try:
            address = ipaddress.ip_address(peer.strip("[]"))
        except ValueError:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return any(address in network for network in self.trusted)

    def identity(self, *, peer: str, headers) -> SsoIdentity | None:
        """Who the proxy says this request is from; None when the request carries no user
        header, or carries one from a peer that is not a trusted proxy (logged). `headers`:
        the request's headers (case-insensitive mapping). The name is checked as sent (ASCII
        before it is lowercased: sso.username_of)."""
        user = headers.get(self.user_header)
        if user is None:
            return None
        if not self.peer_trusted(peer):
            log.warning("ignored the %s header of a request from %s, which is not a trusted "
                        "proxy (EXITPLANE_TRUSTED_PROXIES)", self.user_header, peer or "unknown")
            return None
        user = user.strip()[:MAX_USER_CHARS]
        if not user:
            return None
        groups: tuple[str, ...] = ()
        if self.groups_header:
            raw = (headers.get(self.groups_header) or "")[:MAX_GROUPS_CHARS]
            groups = tuple(group.strip() for group in raw.split(",") if group.strip())
            groups = groups[:MAX_GROUPS]
        # An ASCII name is lowercased here; any other stays as sent, for sign-in to refuse.
        return SsoIdentity(username=username_of(user) or user, groups=groups, method="proxy")
