"""Who is on the other end of a request: the client address behind trusted proxies, and the
key an address is throttled under.

X-Forwarded-For is read only when the connection comes from a trusted proxy
(`EXITPLANE_TRUSTED_PROXIES`); anyone else can write anything in it. The header is walked from
the right, past every trusted proxy, to the first address that is not one: the client as the
outermost trusted proxy saw it. An entry that is not an IP address ends the walk at the proxy
that passed it on.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from controlplane.settings import Network

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

# One IPv6 subscriber is given a /64 (often more): an address inside it is as good as another.
IPV6_CLIENT_PREFIX = 64


def _address(text: str) -> Address | None:
    try:
        address = ipaddress.ip_address(text.strip().strip("[]"))
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def client_address(peer: str, forwarded_for: Iterable[str],
                   trusted: tuple[Network, ...]) -> str:
    """The client's address: `peer` (the connection's), or what trusted proxies say behind it
    in the X-Forwarded-For values `forwarded_for`."""
    hops = [hop.strip() for value in forwarded_for for hop in value.split(",") if hop.strip()]
    client = peer
    while hops:
        address = _address(client)
        if address is None or not any(address in network for network in trusted):
            break
        if _address(hops[-1]) is None:
            break
        client = hops.pop()
    address = _address(client)
    return str(address) if address is not None else client


def throttle_key(address: str) -> str:
    """What `address` is throttled under: an IPv4 address itself, an IPv6 address's /64 (its
    holder has the whole network to rotate through), anything else as given."""
    parsed = _address(address)
    if isinstance(parsed, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((parsed, IPV6_CLIENT_PREFIX), strict=False))
    return str(parsed) if parsed is not None else address
