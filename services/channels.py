"""gRPC channels between services: every client channel of the stack is opened here,
so that what each call carries (deadlines' defaults, credentials) is decided in one place."""

from __future__ import annotations

import grpc


def open_channel(address: str, token: str | None = None) -> grpc.aio.Channel:
    """A channel to another service of the stack at `address` (host:port).

    `token` is the cluster token (StackConfig.cluster_token); None where none is set."""
    del token  # not yet sent: services accept calls without it
    return grpc.aio.insecure_channel(address)
