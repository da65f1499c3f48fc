"""gRPC channels between services: every client channel of the stack is opened here,
so that what each call carries (deadlines' defaults, credentials) is decided in one place.

With a cluster token every call carries it in its metadata (services/auth.py has the
server's side). It is added where a call starts, by wrapping the channel's method
factories, not by a client interceptor: grpc.aio routes every message of an intercepted
streaming call through an extra queue, and the model workers' Decode streams are the
decode loop's hot path.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Any

import grpc

from lamina.services.auth import TOKEN_METADATA_KEY

# A peer whose link was cut sends no reset: without pings a channel keeps its dead
# connection for the minutes TCP takes to give up, and every call on it (or on a new
# channel to the same address, which would share it) waits that long. Pinged every
# KEEPALIVE_MS, a connection that does not answer within KEEPALIVE_TIMEOUT_MS is dropped
# and the next call connects anew; each channel has its own connections, so one opened
# to replace a lost peer's never inherits the stale one. Servers allow the pings
# (SERVER_OPTIONS).
KEEPALIVE_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
CHANNEL_OPTIONS = [("grpc.keepalive_time_ms", KEEPALIVE_MS), ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
                   ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
                   ("grpc.use_local_subchannel_pool", 1)]
SERVER_OPTIONS = [("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
                  ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_ping_strikes", 0)]


def open_channel(address: str, token: str | None = None) -> grpc.aio.Channel:
    """A channel to another service of the stack at `address` (host:port).

    `token` is the cluster token (StackConfig.cluster_token); None where none is set,
    and then calls carry nothing (a service with a token refuses them)."""
    channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    if token is None:
        return channel
    return _TokenChannel(channel, ((TOKEN_METADATA_KEY, token),))


# How long a replaced channel stays open for the calls still on it. Its peer has moved (a
# restart), so they fail by themselves or are cancelled then; short, since a service that
# stops waits for it.
RETIRE_GRACE_S = 2.0


class Channels:
    """A service's client channels, one per peer (a key: ("model", "model-2"), "scheduler"),
    each closed when it is replaced or with the service.

    A peer that comes back at another address gets a new channel; the one it replaces is
    closed `grace_s` later (calls still on it end first, or are cancelled then), by a task
    of this object, so that channels to peers that are gone do not accumulate over
    restarts. Used from the service's event loop."""

    def __init__(self, token: str | None, grace_s: float = RETIRE_GRACE_S) -> None:
        self._token = token
        self._grace_s = grace_s
        self._open: dict[Hashable, grpc.aio.Channel] = {}
        self._closing: set[asyncio.Task] = set()

    def open(self, key: Hashable, address: str) -> grpc.aio.Channel:
        """A new channel to `address` for peer `key`; the peer's channel before it is retired."""
        channel = open_channel(address, self._token)
        self.replace(key, channel)
        return channel

    def replace(self, key: Hashable, channel: grpc.aio.Channel) -> None:
        """`channel`, opened elsewhere, becomes peer `key`'s; the one before it is retired."""
        old = self._open.get(key)
        self._open[key] = channel
        if old is not None and old is not channel:
            task = asyncio.get_running_loop().create_task(old.close(self._grace_s), name=f"close-channel-{key}")
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def __len__(self) -> int:
        """Channels open and not retired."""
        return len(self._open)

    async def close(self) -> None:
        """Every channel: the open ones now, the retired ones at the end of their grace
        (a graceful close that is cancelled leaves grpc's channel open, so it is awaited)."""
        channels, self._open = list(self._open.values()), {}
        await asyncio.gather(*self._closing, *(c.close() for c in channels), return_exceptions=True)


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
