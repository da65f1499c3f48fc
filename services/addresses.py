"""Where a service binds versus the address it gives its peers.

A service binds `host` (an interface, or a wildcard such as 0.0.0.0 in a container) and
registers its endpoints in the metadata store; peers on other hosts connect to what is
registered, so a wildcard must never be registered. The advertised host is
`advertise_host` when set; else `host` itself, or, for a wildcard, the address this
machine's hostname resolves to (in a container or a pod: its own IP, from /etc/hosts).
"""

from __future__ import annotations

import socket

WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def advertised_host(host: str, advertise_host: str | None) -> str:
    """The host peers are given for a service bound on `host`."""
    if advertise_host:
        return advertise_host
    if host not in WILDCARD_HOSTS:
        return host
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError:
        return name  # unresolvable here; peers may still resolve it through their DNS


def host_port(host: str, port: int) -> str:
    """`host:port`, with an IPv6 literal in brackets (as gRPC and URLs want it)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def with_host(address: str, host: str) -> str:
    """A bound `[scheme://]host:port` address with its host replaced by `host`; an
    address without a port (a shared-memory name) is returned as it is."""
    scheme, sep, rest = address.rpartition("://")
    bound, colon, port = rest.rpartition(":")
    if not colon or not port.isdigit() or not bound:
        return address
    return f"{scheme}{sep}{host_port(host, int(port))}"
