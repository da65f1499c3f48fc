"""Prefix KV between prefill workers, over the data plane.

`PrefixServer` answers FETCH_PREFIX frames on a prefill worker's data-plane listener
with the KV of the longest prefix of the asked tokens that its prefix cache holds, read
from whichever tier holds each block (device, host or disk; 4-bit blocks dequantized)
without moving any (lamina.kvstore.prefix_cache.read; the cache is thread-safe). It runs its
own event loop on a thread of its own (`start` / `stop`): the worker's own loop is held
by each prefill forward, and a peer waiting for prefix KV must not wait for that
forward too (torch and the socket calls release the GIL, so both proceed).

`PrefixFetcher` is the asking side. It keeps one connection per peer address, opened
on first use; one fetch at a time per connection, so a reply is matched by its tag
alone. A fetch that fails, is refused, is late (`timeout_s`) or answers KV of the wrong
shape closes that connection and gives nothing: the asker computes those tokens
itself. A fetch only saves time; no request depends on one.

Ownership: the fetcher owns its connections (`close()`); the server owns its thread,
event loop and listener (`stop()` closes the listener and joins the thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

import torch

from lamina import transports
from lamina.kvstore.prefix_cache import PrefixCache
from lamina.model.config import ModelConfig
from lamina.services.wire import (
    FetchPrefix,
    Kind,
    PrefixKV,
    RemoteError,
    error_frame,
    expect,
    frame_tag,
    incoming,
    short_repr,
)

log = logging.getLogger(__name__)

# Weight of the newest fetch in the fetcher's running bandwidth figure.
_EMA = 0.3


class PrefixServer:
    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache
        self.num_served_tokens = 0  # prefix tokens sent to peers
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    async def start(self, address: str, tcfg: transports.TransportConfig) -> str:
        """Listen at `address` on the server's own thread; returns the bound address."""
        started: asyncio.Future = asyncio.get_running_loop().create_future()
        caller = asyncio.get_running_loop()

        def report(result: str | BaseException) -> None:
            if started.done():
                return
            if isinstance(result, BaseException):
                started.set_exception(result)
            else:
                started.set_result(result)

        async def main() -> None:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            try:
                listener = await transports.listen(address, self.serve, tcfg)
            except BaseException as exc:  # noqa: BLE001 - reported to the caller
                caller.call_soon_threadsafe(report, exc)
                return
            caller.call_soon_threadsafe(report, listener.address)
            try:
                await self._stop.wait()
            finally:
                await listener.close()

        self._thread = threading.Thread(target=asyncio.run, args=(main(),), name="prefix-server", daemon=True)
        self._thread.start()
        return await started

    async def stop(self) -> None:
        if self._thread is None:
            return
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    async def serve(self, conn: transports.Connection) -> None:
        """Answer one peer's fetches until it closes the connection."""
        async for frame in incoming(conn, "prefix fetch"):
            reply = await self._answer(frame)
            try:
                await conn.send(reply)
            except transports.TransportError as exc:
                log.warning("prefix fetch reply to %s failed: %s", conn.peer, exc)
                return

    async def _answer(self, frame: transports.Frame) -> transports.Frame:
        try:
            tag = frame_tag(frame)
        except RemoteError as exc:
            return error_frame(None, exc.code, str(exc))
        try:
            if frame.kind != Kind.FETCH_PREFIX:
                raise RemoteError("protocol", f"a prefill worker's data plane answers FETCH_PREFIX only, "
                                              f"got frame kind {short_repr(frame.kind)}")
            msg = FetchPrefix.from_frame(frame)
            num_tokens, kv = self._read(msg)  # this loop's thread serves fetches alone: reading here is fine
        except RemoteError as exc:
            return error_frame(tag, exc.code, str(exc))
        except Exception as exc:  # a failure here must not end the peer's link
            log.exception("prefix fetch failed")
            return error_frame(tag, "internal", f"{type(exc).__name__}: {exc}")
        return PrefixKV(tag, num_tokens, kv).to_frame()

    def _read(self, msg: FetchPrefix) -> tuple[int, torch.Tensor | None]:
        num_tokens, kv = self.cache.read(msg.tokens)
        if num_tokens <= msg.start:
            return num_tokens, None
        assert kv is not None  # the cache holds KV for each of its num_tokens > 0 tokens
        kv = kv[:, :, msg.start:].contiguous().cpu()  # [L, 2, num_tokens - start, Hkv, D]; sent from CPU memory
        self.num_served_tokens += kv.shape[2]
        return num_tokens, kv


class PrefixFetcher:
    def __init__(self, tcfg: transports.TransportConfig, cfg: ModelConfig, timeout_s: float,
                 dtype: torch.dtype = torch.float32) -> None:
        self._tcfg = tcfg
        self._cfg = cfg
        self._dtype = dtype
        self._timeout_s = timeout_s
        self._conns: dict[str, transports.Connection] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._num_sent = 0
        self.bytes_per_s: float | None = None  # running figure of the fetches' bandwidth
        self.num_fetched_tokens = 0
        self.num_failed = 0

    async def fetch(self, address: str, tokens: list[int], start: int) -> tuple[int, torch.Tensor | None]:
        """(n, kv): the peer at `address` holds the first n of `tokens`, and kv is the KV
        of tokens[start:n] ([L, 2, n - start, Hkv, D]); (start, None) when it holds no
        more than `start` tokens or the fetch failed."""
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:
            began = time.perf_counter()
            try:
                num_tokens, kv = await asyncio.wait_for(self._exchange(address, tokens, start), self._timeout_s)
            except (TimeoutError, transports.TransportError, RemoteError) as exc:
                self.num_failed += 1
                log.warning("prefix fetch from %s failed (%s); computing those tokens instead",
                            address, str(exc) or type(exc).__name__)
                await self._drop(address)
                return start, None
            if kv is None:
                return start, None
            seconds = time.perf_counter() - began
            rate = kv.numel() * kv.element_size() / max(seconds, 1e-6)
            self.bytes_per_s = rate if self.bytes_per_s is None else (1 - _EMA) * self.bytes_per_s + _EMA * rate
            self.num_fetched_tokens += num_tokens - start
            return num_tokens, kv

    async def _exchange(self, address: str, tokens: list[int], start: int) -> tuple[int, torch.Tensor | None]:
        conn = self._conns.get(address)
        if conn is None:
            conn = self._conns[address] = await transports.connect(address, self._tcfg)
        self._num_sent += 1
        tag = (self._num_sent,)
        await conn.send(FetchPrefix(tag, tokens, start).to_frame())
        msg = PrefixKV.from_frame(expect(await conn.recv(), Kind.PREFIX_KV))
        if msg.tag != tag:
            raise RemoteError("protocol", f"reply tagged {msg.tag}, expected {tag}")
        if msg.num_tokens <= start:
            return start, None
        c = self._cfg
        want = (c.num_layers, 2, msg.num_tokens - start, c.num_kv_heads, c.head_dim)
        if msg.num_tokens > len(tokens) or msg.kv is None or tuple(msg.kv.shape) != want or msg.kv.dtype != self._dtype:
            got = None if msg.kv is None else (tuple(msg.kv.shape), msg.kv.dtype)
            raise RemoteError("bad_request", f"{msg.num_tokens} of {len(tokens)} tokens with KV {got}, "
                                             f"expected {want} {self._dtype}")
        return msg.num_tokens, msg.kv

    async def _drop(self, address: str) -> None:
        conn = self._conns.pop(address, None)
        if conn is not None:
            with contextlib.suppress(transports.TransportError):
                await conn.close()

    async def close(self) -> None:
        for address in list(self._conns):
            await self._drop(address)
