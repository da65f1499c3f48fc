"""A free TCP port on this host for a listener started next (the embedded Redis, a test's
or a measurement's `lamina up`).

The port is taken below the kernel's ephemeral range. One the kernel hands out for a bind
to port 0 is free only until its listener binds it, and meanwhile every outgoing
connection and every other listener bound to port 0 (a stack has several) draws from that
same range: once, a gateway's health check reached a data-plane listener that had taken
the gateway's port.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Where Linux's ephemeral range starts when /proc does not say (its default).
DEFAULT_EPHEMERAL_LOW = 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port that nothing on `host` listens on now, below the ephemeral range (RuntimeError
    when 100 draws all found theirs taken)."""
    low = ephemeral_low()
    for _ in range(100):
        port = random.randrange(max(1024, low - 10000), low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port found on {host} below {low}")


def bind_error(host: str, port: int) -> OSError | None:
    """Why a listener could not bind `host`:`port` now (None: it could), trying every
    address the host resolves to, as an HTTP server binds them (SO_REUSEADDR: a port left
    in TIME_WAIT by a stopped server counts as free). EADDRINUSE: something holds the port
    there; any other error (a name that does not resolve, an address not of this host, a
    privileged port) says the host or port cannot be listened on at all."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return exc
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # bound alone, as the IPv4 address gets its own socket
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(address)
            except OSError as exc:
                return exc
    return None


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's /proc; its default elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW
