"""lamina.ports.free_port: a port below the kernel's ephemeral range that nothing holds."""

from __future__ import annotations

import socket

import pytest

from lamina import ports


def test_a_free_port_is_below_the_ephemeral_range_and_binds():
    low = ports.ephemeral_low()
    for _ in range(20):
        port = ports.free_port()
        assert max(1024, low - 10000) <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # nothing holds it


def test_a_port_held_is_never_handed_out_and_none_free_is_an_error(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        # Every draw lands on the held port: the error names the host and the range's start.
        monkeypatch.setattr(ports.random, "randrange", lambda a, b: taken)
        with pytest.raises(RuntimeError, match=r"no free port found on 127\.0\.0\.1 below \d+"):
            ports.free_port()
