"""The hook guard refuses every IANA special-purpose range from its own table, whatever the
Python release's `ipaddress` flags say (3.11.7 called 192.0.0.192, a cloud metadata address,
192.0.0.8 and 6to4 public), and looks inside IPv6 forms that carry an IPv4 address (6to4,
Teredo, NAT64, IPv4-mapped and IPv4-compatible) so an inward IPv4 address cannot hide in one."""

from __future__ import annotations

import ipaddress

import pytest

from controlplane.alerts.guard import (
    SPECIAL_IPV4,
    SPECIAL_IPV6,
    AllowList,
    DestinationRefused,
    HookGuard,
)
from controlplane.keys import Vault


def guard(allowed: str = "", answers: dict[str, list[str]] | None = None) -> HookGuard:
    answers = answers or {}
    return HookGuard(vault=Vault("test-secret-key"), allowed=AllowList.parse(allowed),
                     resolve=lambda host, port: answers.get(host, []))


def refused(url: str, **kwargs) -> str:
    with pytest.raises(DestinationRefused) as caught:
        guard(**kwargs).check(url, kind="webhook")
    return str(caught.value)


@pytest.mark.parametrize("address, says", [
    ("192.0.0.192", "IETF protocol assignment"),  # Oracle Cloud's metadata service
    ("192.0.0.8", "IPv4 dummy"),
    ("192.0.0.1", "service continuity"),
    ("192.0.0.170", "IETF protocol assignment"),
    ("192.31.196.1", "AS112"), ("192.52.193.1", "AMT"), ("192.88.99.1", "6to4 relay"),
    ("192.175.48.1", "AS112"), ("198.18.0.1", "benchmarking"), ("198.19.255.254", "benchmark"),
    ("192.0.2.1", "documentation"), ("198.51.100.7", "documentation"),
    ("203.0.113.9", "documentation"), ("0.1.2.3", "this-network"), ("0.0.0.0", "unspecified"),
    ("240.0.0.1", "reserved"), ("255.255.255.255", "broadcast"), ("239.1.1.1", "multicast"),
    ("100.127.255.1", "CGNAT"), ("169.254.169.254", "link-local"), ("127.8.9.10", "loopback"),
])
def test_special_purpose_ipv4_ranges_are_refused(address, says):
    assert says in refused(f"http://{address}/")


@pytest.mark.parametrize("address, says", [
    ("2002:7f00:1::1", "6to4 address carrying the loopback address 127.0.0.1"),
    ("2002:a9fe:a9fe::", "6to4 address carrying the link-local address 169.254.169.254"),
    ("2002:c000:c0::", "6to4 address carrying the IETF protocol assignment address 192.0.0.192"),
    ("2002:808:808::1", "a 6to4 address"),  # public inside, still not a hook's destination
    ("64:ff9b::7f00:1", "NAT64 address carrying the loopback address 127.0.0.1"),
    ("64:ff9b::a9fe:a9fe", "NAT64 address carrying the link-local address 169.254.169.254"),
    ("64:ff9b::c000:c0", "NAT64 address carrying the IETF protocol assignment address"),
    ("64:ff9b:1::a00:1", "NAT64 address carrying the private address 10.0.0.1"),
    ("64:ff9b:1::808:808", "local-use NAT64"),
    # Teredo: the client's address is stored inverted (here 127.0.0.1 and 169.254.169.254)
    ("2001:0:4136:e378:8000:63bf:80ff:fffe", "Teredo address carrying the loopback"),
    ("2001:0:4136:e378:8000:63bf:5601:5601", "Teredo address carrying the link-local"),
    ("2001:0:808:808:8000:63bf:f7f7:f7f7", "Teredo"),
    ("::127.0.0.1", "IPv4-compatible address carrying the loopback address 127.0.0.1"),
    ("::ffff:192.0.0.192", "IETF protocol assignment"),
    ("::ffff:169.254.169.254", "link-local"),
    ("::", "unspecified"), ("::1", "loopback"), ("100::1", "discard-only"),
    ("2001:db8::1", "documentation"), ("3fff::1", "documentation"),
    ("2001:2::1", "benchmarking"), ("2001:20::1", "ORCHIDv2"), ("5f00::1", "segment routing"),
    ("fd12:3456::1", "unique-local"), ("fe80::1", "link-local"), ("fec0::1", "site-local"),
    ("ff02::1", "multicast"), ("4000::1", "reserved"), ("::8.8.8.8", "reserved"),
])
def test_special_purpose_ipv6_ranges_and_carried_ipv4_are_refused(address, says):
    message = refused(f"http://[{address}]/")
    assert says in message, message
    assert "EXITPLANE_HOOK_ALLOWED_HOSTS" in message


def test_a_name_resolving_to_a_wrapped_inward_address_is_refused():
    message = refused("http://hooks.example.com/",
                      answers={"hooks.example.com": ["2002:a9fe:a9fe::1"]})
    assert "resolves to a 6to4 address carrying the link-local address" in message


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111",
                                     "64:ff9b::808:808", "192.0.1.1", "198.20.0.1"])
def test_ordinary_public_addresses_and_nat64_of_public_ones_pass(address):
    host = f"[{address}]" if ":" in address else address
    destination = guard().check(f"https://{host}/hook", kind="webhook")
    assert destination.address == address


def test_the_table_is_the_registry_not_the_python_flags():
    """Every entry the registries list is in the table (spot checks where 3.11 and 3.13
    disagree), and membership is decided by the table alone."""
    networks = {str(network) for network, _ in SPECIAL_IPV4 + SPECIAL_IPV6}
    for network in ("192.0.0.0/24", "192.0.0.8/32", "2002::/16", "2001::/32", "64:ff9b:1::/48",
                    "100::/64", "2001::/23", "3fff::/20", "5f00::/16", "198.18.0.0/15"):
        assert network in networks
    assert all(isinstance(network, (ipaddress.IPv4Network, ipaddress.IPv6Network))
               for network, _ in SPECIAL_IPV4 + SPECIAL_IPV6)


def test_the_allow_list_still_admits_listed_networks_and_names():
    assert guard("192.0.0.0/24").check("http://192.0.0.192/", kind="webhook")
    assert guard("64:ff9b:1::/48,10.0.0.0/8").check("http://[64:ff9b:1::a00:1]/",
                                                      kind="webhook")
    assert guard("alertmanager.internal").check(
        "http://alertmanager.internal/", kind="webhook",
        must_resolve=False) is None  # listed by name: DNS decides at delivery
    named = guard("alertmanager.internal", answers={"alertmanager.internal": ["2002:7f00:1::"]})
    assert named.check("http://alertmanager.internal/", kind="webhook")
    # Listing the IPv6 range is not listing the IPv4 address it carries.
    message = refused("http://[2002:7f00:1::]/", allowed="2002::/16")
    assert "carrying the loopback address 127.0.0.1" in message
    assert guard("2002::/16,127.0.0.0/8").check("http://[2002:7f00:1::]/", kind="webhook")
