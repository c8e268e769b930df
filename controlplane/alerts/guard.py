"""Where a hook may send (issue 13): no server-side request forgery through alert hooks.

A hook's URL is checked when the hook is created or changed and again at every delivery:
the host is resolved, and every address it resolves to must be public (not loopback,
link-local, private, unique-local, CGNAT, multicast, unspecified or reserved) unless the host
name, the address or a network holding it is on `EXITPLANE_HOOK_ALLOWED_HOSTS`. Internal-looking
names (`redis`, `*.svc.cluster.local`, `*.internal`) are refused without asking DNS. Slack and
PagerDuty hooks go only to their official hosts over https. Delivery then connects to the very
address that was checked (`Destination.address`), so DNS cannot answer differently between the
check and the connection.
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from controlplane.errors import Invalid
from controlplane.keys import Vault, vault

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], list[str]]

OFFICIAL_HOSTS = {"slack": frozenset({"hooks.slack.com"}),
                  "pagerduty": frozenset({"events.pagerduty.com", "events.eu.pagerduty.com"})}
INTERNAL_SUFFIXES = (".localhost", ".local", ".internal", ".intranet", ".lan", ".home.arpa",
                     ".svc", ".cluster.local", ".corp", ".localdomain")
SETTING = "EXITPLANE_HOOK_ALLOWED_HOSTS"


class DestinationRefused(Invalid):
    """The hook's URL points where hooks may not go (422 at creation; logged at delivery)."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True)
class AllowList:
    """Host names, addresses and networks hooks may reach although they are not public."""

    names: frozenset[str] = frozenset()
    networks: tuple[Network, ...] = ()

    @classmethod
    def parse(cls, text: str) -> AllowList:
        names, networks = set(), []
        for entry in (part.strip().lower() for part in text.split(",")):
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                names.add(entry.rstrip("."))
        return cls(frozenset(names), tuple(networks))

    def holds(self, address: Address) -> bool:
        return any(address in network for network in self.networks)


def system_resolver(host: str, port: int) -> list[str]:
    """Every address `host` resolves to for a TCP connection (DNS, /etc/hosts)."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return []
    return list(dict.fromkeys(info[4][0] for info in found))


@dataclass(frozen=True)
class Destination:
    """A vetted URL and the address the connection must use."""

    url: httpx.URL
    address: str


@dataclass(frozen=True)
class HookGuard:
    """What hook code needs from the settings: the allow-list, the vault of hook credentials
    and (replaceable in tests) the resolver and the TLS trust."""

    vault: Vault
    allowed: AllowList = AllowList()
    resolve: Resolver = field(default=system_resolver)
    # Certificates are verified against the hook's host name (True: the system's trust store).
    tls_verify: ssl.SSLContext | bool = True

    @classmethod
    def from_settings(cls, settings) -> HookGuard:
        return cls(vault=vault(settings), allowed=AllowList.parse(settings.hook_allowed_hosts))

    def check(self, url: str, *, kind: str, must_resolve: bool = True) -> Destination | None:
        """The destination of `url` for a hook of `kind`, or DestinationRefused saying why.

        With `must_resolve=False` (creating a hook) a name DNS does not know now is accepted:
        delivery resolves it again and refuses it then if it points inward."""
        parsed = httpx.URL(url)
        host = parsed.host.lower().rstrip(".")
        if parsed.scheme not in ("http", "https") or not host:
            raise DestinationRefused("a hook URL must be http(s)://host/...")
        literal = _address(host)
        allowed_name = host in self.allowed.names or (
            literal is not None and self.allowed.holds(literal))
        official = OFFICIAL_HOSTS.get(kind)
        if official and not allowed_name and (host not in official or parsed.scheme != "https"):
            raise DestinationRefused(f"a {kind} hook must be https://{sorted(official)[0]}/..."
                                     + (" (or events.eu.pagerduty.com)" if kind == "pagerduty"
                                        else ""))
        if literal is not None:
            addresses = [literal]
        else:
            if not allowed_name and ("." not in host or host.endswith(INTERNAL_SUFFIXES)):
                raise DestinationRefused(f"{host!r} is an internal host name; hooks may only "
                                         f"reach it when it is listed in {SETTING}")
            port = parsed.port or (443 if parsed.scheme == "https" else 80)
            addresses = [a for a in (_address(found) for found in self.resolve(host, port)) if a]
            if not addresses:
                if must_resolve:
                    raise DestinationRefused(f"{host!r} does not resolve", retryable=True)
                return None
        for address in addresses:
            category = _non_public(address)
            if category and not allowed_name and not self.allowed.holds(address):
                article = "an" if category[0] in "aeiou" else "a"
                raise DestinationRefused(
                    f"{host!r} {'is' if literal else 'resolves to'} {article} {category} "
                    f"address; hooks may only reach it when it is listed in {SETTING}")
        return Destination(url=parsed, address=str(addresses[0]))


def _address(text: str) -> Address | None:
    try:
        address = ipaddress.ip_address(text.strip("[]").split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    return address


def _non_public(address: Address) -> str | None:
    """Why `address` is not a public unicast address, or None when it is."""
    checks = (("loopback", address.is_loopback), ("link-local", address.is_link_local),
              ("unspecified", address.is_unspecified), ("multicast", address.is_multicast),
              ("private", address.is_private),
              ("shared (CGNAT)", address in ipaddress.ip_network("100.64.0.0/10")),
              ("reserved", address.is_reserved or not address.is_global))
    return next((name for name, hit in checks if hit), None)
