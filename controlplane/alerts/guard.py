"""Where a hook may send: no server-side request forgery through alert hooks.

A hook's URL is checked when the hook is created or changed and again at every delivery:
the host is resolved, and every address it resolves to must be ordinary public unicast (in no
range of the IANA special-purpose registries, which `SPECIAL_IPV4` and `SPECIAL_IPV6` spell out,
and, for 6to4, Teredo, NAT64 and IPv4-compatible addresses, carrying no such IPv4 address)
unless the host name, the address or a network holding it is on
`EXITPLANE_HOOK_ALLOWED_HOSTS`. Internal-looking
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
        listed_name = host in self.allowed.names
        allowed_name = listed_name or (literal is not None and self.allowed.holds(literal))
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
            # A listed network admits its addresses, not the IPv4 addresses they carry.
            refusal = None if listed_name else _non_public(address, self.allowed)
            if refusal:
                raise DestinationRefused(
                    f"{host!r} {'is' if literal else 'resolves to'} {refusal}; hooks may "
                    f"only reach it when it is listed in {SETTING}")
        return Destination(url=parsed, address=str(addresses[0]))


def _address(text: str) -> Address | None:
    try:
        address = ipaddress.ip_address(text.strip("[]").split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    return address


def _table(*rows: tuple[str, str]) -> tuple[tuple[Network, str], ...]:
    return tuple((ipaddress.ip_network(network), name) for network, name in rows)


# The IANA IPv4 and IPv6 Special-Purpose Address Registries (plus multicast and IPv6 site-local),
# written out here rather than read from `ipaddress`'s is_private / is_global flags, whose
# tables differ between Python releases. Every entry is refused, including the few the
# registry marks globally reachable (anycast and AS112 services): no hook has reason to reach
# them. The one exception is the well-known NAT64 prefix (below), judged by the IPv4 address
# it carries. More specific entries come first, so the message names the narrowest range.
SPECIAL_IPV4 = _table(
    ("0.0.0.0/32", "unspecified"),
    ("0.0.0.0/8", "this-network"),
    ("10.0.0.0/8", "private"),
    ("100.64.0.0/10", "shared (CGNAT)"),
    ("127.0.0.0/8", "loopback"),
    ("169.254.0.0/16", "link-local"),
    ("172.16.0.0/12", "private"),
    ("192.0.0.0/29", "IPv4 service continuity (DS-Lite)"),
    ("192.0.0.8/32", "IPv4 dummy"),
    ("192.0.0.0/24", "IETF protocol assignment"),  # 192.0.0.192: a cloud metadata service
    ("192.0.2.0/24", "documentation"),
    ("192.31.196.0/24", "AS112"),
    ("192.52.193.0/24", "AMT"),
    ("192.88.99.0/24", "6to4 relay anycast"),
    ("192.168.0.0/16", "private"),
    ("192.175.48.0/24", "AS112"),
    ("198.18.0.0/15", "benchmarking"),
    ("198.51.100.0/24", "documentation"),
    ("203.0.113.0/24", "documentation"),
    ("224.0.0.0/4", "multicast"),
    ("255.255.255.255/32", "broadcast"),
    ("240.0.0.0/4", "reserved"),
)
SPECIAL_IPV6 = _table(
    ("::/128", "unspecified"),
    ("::1/128", "loopback"),
    ("::ffff:0:0/96", "IPv4-mapped"),
    ("64:ff9b:1::/48", "local-use NAT64"),
    ("100::/64", "discard-only"),
    ("100:0:0:1::/64", "dummy"),
    ("2001::/32", "Teredo"),
    ("2001:2::/48", "benchmarking"),
    ("2001:db8::/32", "documentation"),
    ("2001:10::/28", "ORCHID"),
    ("2001:20::/28", "ORCHIDv2"),
    ("2001::/23", "IETF protocol assignment"),
    ("2002::/16", "6to4"),
    ("2620:4f:8000::/48", "AS112"),
    ("3fff::/20", "documentation"),
    ("5f00::/16", "segment routing"),
    ("fc00::/7", "unique-local"),
    ("fe80::/10", "link-local"),
    ("fec0::/10", "site-local"),
    ("ff00::/8", "multicast"),
)
NAT64 = ipaddress.ip_network("64:ff9b::/96")  # RFC 6052: reaches the IPv4 address it carries
NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
GLOBAL_UNICAST = ipaddress.ip_network("2000::/3")  # the rest of IPv6 is unallocated
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")


def _embedded_ipv4(address: ipaddress.IPv6Address) -> list[tuple[ipaddress.IPv4Address, str]]:
    """The IPv4 addresses an IPv6 address carries, each with the form that carries it:
    6to4, Teredo (server and client), NAT64 and IPv4-compatible."""
    found = []
    if address.sixtofour is not None:
        found.append((address.sixtofour, "6to4"))
    if address.teredo is not None:
        server, client = address.teredo
        found += [(server, "Teredo"), (client, "Teredo")]
    if address in NAT64 or address in NAT64_LOCAL:
        # RFC 6052's /96 form (a local-use prefix cut shorter is the operator's own to list)
        found.append((ipaddress.IPv4Address(int(address) & 0xFFFFFFFF), "NAT64"))
    elif address in _IPV4_COMPATIBLE and int(address) > 1:
        found.append((ipaddress.IPv4Address(int(address)), "IPv4-compatible"))
    return found


def _special(address: Address) -> str | None:
    """The special-purpose range `address` is in, or None when it is ordinary unicast (for
    NAT64: when the IPv4 address it carries is)."""
    table = SPECIAL_IPV4 if address.version == 4 else SPECIAL_IPV6
    for network, name in table:
        if address in network:
            return name
    if address.version == 6 and address not in GLOBAL_UNICAST and address not in NAT64:
        return "reserved"
    return None


def _non_public(address: Address, allowed: AllowList = AllowList()) -> str | None:
    """Why `address` may not be reached ("a loopback address", "a 6to4 address carrying the
    loopback address 127.0.0.1"), or None when it may: it and every IPv4 address it carries
    must be ordinary unicast or on the allow-list."""
    if address.version == 6:
        for ipv4, form in _embedded_ipv4(address):
            inner = _special(ipv4)
            if inner and not allowed.holds(ipv4):
                return f"{_article(form)} {form} address carrying the {inner} address {ipv4}"
    category = _special(address)
    if category and not allowed.holds(address):
        return f"{_article(category)} {category} address"
    return None


def _article(word: str) -> str:
    lower = word.lower()
    return "an" if lower[0] in "aeio" or (lower[0] == "u" and not lower.startswith("uni")) \
        else "a"
