"""gRPC channels between services: every client channel of the stack is opened here,
so that what each call carries (deadlines' defaults, credentials) is decided in one place.

With a cluster token every call carries it in its metadata (services/auth.py has the
server's side). It is added where a call starts, by wrapping the channel's method
factories, not by a client interceptor: grpc.aio routes every message of an intercepted
streaming call through an extra queue, and the model workers' Decode streams are the
decode loop's hot path.
"""

from __future__ import annotations

from typing import Any

import grpc

from lamina.services.auth import TOKEN_METADATA_KEY


def open_channel(address: str, token: str | None = None) -> grpc.aio.Channel:
    """A channel to another service of the stack at `address` (host:port).

    `token` is the cluster token (StackConfig.cluster_token); None where none is set,
    and then calls carry nothing (a service with a token refuses them)."""
    channel = grpc.aio.insecure_channel(address)
    if token is None:
        return channel
    return _TokenChannel(channel, ((TOKEN_METADATA_KEY, token),))


class _TokenChannel(grpc.aio.Channel):
    """A channel whose every call carries `metadata` besides the caller's own."""

    def __init__(self, channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...]) -> None:
        self._channel = channel
        self._metadata = metadata

    async def __aenter__(self) -> _TokenChannel:
        await self._channel.__aenter__()
        return self

    async def __aexit__(self, exc_type, exc_val, exc_tb) -> None:
        await self._channel.__aexit__(exc_type, exc_val, exc_tb)

    async def close(self, grace: float | None = None) -> None:
        await self._channel.close(grace)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self._channel.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self._channel.channel_ready()

    def unary_unary(self, *args: Any, **kwargs: Any) -> _WithMetadata:
        return _WithMetadata(self._channel.unary_unary(*args, **kwargs), self._metadata)

    def unary_stream(self, *args: Any, **kwargs: Any) -> _WithMetadata:
        return _WithMetadata(self._channel.unary_stream(*args, **kwargs), self._metadata)

    def stream_unary(self, *args: Any, **kwargs: Any) -> _WithMetadata:
        return _WithMetadata(self._channel.stream_unary(*args, **kwargs), self._metadata)

    def stream_stream(self, *args: Any, **kwargs: Any) -> _WithMetadata:
        return _WithMetadata(self._channel.stream_stream(*args, **kwargs), self._metadata)


class _WithMetadata:
    """A multi-callable (what a stub holds per method) that adds metadata to each call."""

    def __init__(self, callable_: Any, metadata: tuple[tuple[str, str], ...]) -> None:
        self._callable = callable_
        self._metadata = metadata

    def __call__(self, *args: Any, metadata: Any = None, **kwargs: Any) -> Any:
        merged = self._metadata if not metadata else tuple(metadata) + self._metadata
        return self._callable(*args, metadata=merged, **kwargs)
