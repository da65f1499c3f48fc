"""A rotational coordinator's executors: itself and the peer model workers' slice services.

`run(tag, j, inputs, attn, context)` claims a free executor (lamina.services.model.rotation's
policy: the one idle longest), runs slice j there and releases it. Each executor
runs one slice at a time, so a peer's link carries one request at a time and its
reply needs no matching beyond the tag check.

A peer that fails, answers with an error or lets `reply_timeout_s` pass is dropped
(its link closed, so a late reply can answer nobody) and the slice runs on the
coordinator instead: a lost peer slows decoding, it never fails a step. Peers are
looked up in the metadata store by `refresh()`, called when a decode stream opens
and, while a peer is missing, at most every `retry_s` from `run`.

Ownership: the executors own the peers' connections and the refresh task; `close()`
ends both.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import torch

from lamina import transports
from lamina.model.splitter import Slice, SliceOutput
from lamina.services.model.rotation import LOCAL, pick_executor
from lamina.services.model.slice_server import RunLocal, from_slice_out, slice_tensors
from lamina.services.wire import Kind, RemoteError, RunSlice, Tag, expect, frame_tag, frame_tensors

log = logging.getLogger(__name__)

# lookup() -> {model worker index: slice service address} of the peers (not the coordinator)
Lookup = Callable[[], Awaitable[dict[int, str]]]


@dataclass
class _Peer:
    address: str
    conn: transports.Connection


class SliceExecutors:
    def __init__(self, slices: Sequence[Slice], run_local: RunLocal, lookup: Lookup,
                 tcfg: transports.TransportConfig, reply_timeout_s: float, num_workers: int,
                 retry_s: float = 2.0) -> None:
        self.slices = slices
        self.num_workers = num_workers  # configured model workers, this one included
        self._run_local = run_local
        self._lookup = lookup
        self._tcfg = tcfg
        self._reply_timeout_s = reply_timeout_s
        self._retry_s = retry_s
        self._peers: dict[int, _Peer] = {}
        self._busy: set[int] = set()
        self._last_used: dict[int, int] = {}
        self._claims = 0
        self._waiters: deque[asyncio.Future] = deque()  # claims waiting for a free executor, in order
        self._refresh_task: asyncio.Task | None = None
        self._refreshed_at = -float("inf")
        self._unreachable: set[str] = set()
        self.remote_slices = 0  # slices run on peers (the rest ran here)
        self.fallbacks = 0  # slices a failed peer left to the coordinator

    @property
    def peers(self) -> list[int]:
        return sorted(self._peers)

    # -- peers ------------------------------------------------------------------------------
    async def refresh(self) -> None:
        """Connect to registered peers not connected yet (or registered anew elsewhere)."""
        self._refreshed_at = time.monotonic()
        try:
            found = await self._lookup()
        except Exception as exc:  # noqa: BLE001 - the store may be down: keep the peers we have
            log.warning("looking up peer model workers failed: %s", exc)
            return
        for index, address in sorted(found.items()):
            peer = self._peers.get(index)
            if peer is not None and peer.address == address:
                continue
            try:
                conn = await asyncio.wait_for(transports.connect(address, self._tcfg), self._reply_timeout_s)
            except (TimeoutError, OSError, transports.TransportError) as exc:
                # Warned once per address: a dead peer stays registered until its lease ends.
                level = logging.DEBUG if address in self._unreachable else logging.WARNING
                self._unreachable.add(address)
                log.log(level, "peer model worker %d at %s unreachable: %s", index, address, exc)
                continue
            self._unreachable.discard(address)
            if index in self._peers:
                await self._drop(index, "registered anew")
            self._peers[index] = _Peer(address, conn)
            log.info("rotational pipeline: peer model worker %d at %s", index, address)
        self._wake_one()  # a new peer is a free executor

    def _maybe_refresh(self) -> None:
        if (self._refresh_task is None or self._refresh_task.done()) \
                and time.monotonic() - self._refreshed_at >= self._retry_s:
            self._refresh_task = asyncio.create_task(self.refresh(), name="slice-peers-refresh")

    async def _drop(self, index: int, why: str) -> None:
        peer = self._peers.pop(index, None)
        if peer is not None:
            log.warning("rotational pipeline: dropping peer model worker %d (%s)", index, why)
            await asyncio.gather(peer.conn.close(), return_exceptions=True)

    async def close(self) -> None:
        if self._refresh_task is not None:
            self._refresh_task.cancel()
            await asyncio.gather(self._refresh_task, return_exceptions=True)
        for index in list(self._peers):
            peer = self._peers.pop(index)
            await asyncio.gather(peer.conn.close(), return_exceptions=True)

    # -- claiming ---------------------------------------------------------------------------
    def _free(self) -> list[int]:
        return [e for e in (LOCAL, *self._peers) if e not in self._busy]

    async def _claim(self) -> int:
        while not self._free():
            wake = asyncio.get_running_loop().create_future()
            self._waiters.append(wake)
            try:
                await wake
            finally:
                if wake in self._waiters:
                    self._waiters.remove(wake)
        ex = pick_executor(self._free(), self._last_used)
        self._busy.add(ex)
        self._claims += 1
        self._last_used[ex] = self._claims
        return ex

    def _release(self, ex: int) -> None:
        # Synchronous, so that a cancelled slice can never leave its executor claimed.
        self._busy.discard(ex)
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            wake = self._waiters.popleft()
            if not wake.done():
                wake.set_result(None)
                return

    # -- running ----------------------------------------------------------------------------
    async def run(self, tag: Tag, j: int, inputs: dict, attn: torch.Tensor | None,
                  context: Sequence[torch.Tensor]) -> SliceOutput:
        """Slice j of a micro-batch's step, on whichever executor is free."""
        if len(self._peers) + 1 < self.num_workers:
            self._maybe_refresh()
        ex = await self._claim()
        try:
            if ex != LOCAL:
                try:
                    out = await self._run_remote(ex, tag, j, inputs, attn, context)
                    self.remote_slices += 1
                    return out
                except (TimeoutError, OSError, transports.TransportError, RemoteError) as exc:
                    self.fallbacks += 1
                    await self._drop(ex, f"{type(exc).__name__}: {exc}")
                except asyncio.CancelledError:
                    # Its reply may still come: a link that carries it would hand it to
                    # the next slice. A new link is made on the next refresh.
                    await self._drop(ex, "a slice on it was cancelled")
                    raise
            return self._run_local(j, inputs, attn, context)
        finally:
            self._release(ex)

    async def _run_remote(self, ex: int, tag: Tag, j: int, inputs: dict, attn: torch.Tensor | None,
                          context: Sequence[torch.Tensor]) -> SliceOutput:
        conn = self._peers[ex].conn
        sl = self.slices[j]
        await conn.send(RunSlice(tag, j, slice_tensors(sl, inputs, attn, context)).to_frame())
        frame = expect(await asyncio.wait_for(conn.recv(), self._reply_timeout_s), Kind.SLICE_OUT)
        if frame_tag(frame) != tuple(tag):
            raise RemoteError("protocol", f"peer model worker {ex} answered {frame_tag(frame)} to {tag}")
        return from_slice_out(sl, frame_tensors(frame, Kind.SLICE_OUT))
