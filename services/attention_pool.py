"""The model side of the data plane: Q, K, V out to the attention workers, outputs back.

Request-level partitioning sends each sequence's rows to the one worker holding
its KV; head-level partitioning sends every row to every worker, each with its
share of the heads, and concatenates the outputs along heads.

Several callers (micro-batches) use the pool at once. Each request frame carries
a tag its reply echoes; one reader task per connection hands every reply to the
future waiting for that tag, so replies are matched by id, never by order. The
pool owns those reader tasks (`close()` cancels and awaits them); a connection
that fails fails every future still waiting on it.

Under the colocated layout (`StackConfig.layout`) the worker holding a model worker's
sequences lives in the model worker's own process: the pool calls its core directly
(`local`), with no frame and no copy, and sends nothing over the transport for it.

With `q_early`, a layer's Q goes out in its own frame before K and V: the worker
starts attention over the KV it already holds as soon as Q arrives and combines
it with the new tokens' part when K and V follow (`lamina.services.attention.attention_core`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, overload

import redis
import torch

from lamina import transports
from lamina.kvstore.metadata import MetadataStore
from lamina.model.config import ModelConfig
from lamina.model.splitter import Attend as AttendCall
from lamina.services.config import StackConfig
from lamina.services.placement import head_range
from lamina.services.runtime import workers_by_index
from lamina.services.wire import Attend, Kind, RemoteError, StoreKV, Tag, expect, frame_tag, result_tensor

log = logging.getLogger(__name__)

T = TypeVar("T")

# reconnect(worker) -> a new connection to that attention worker (wherever it now listens)
Reconnect = Callable[[int], Awaitable[transports.Connection]]


class LocalAttention(Protocol):
    """An attention worker's core in this process (lamina.services.attention.attention_core)."""

    native: bool  # its kernels read CPU memory

    def attend(self, layer: int, seqs: list[tuple[str, int]], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               need_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def local_step(self, seqs: list[tuple[str, int]]) -> AttendCall: ...

    def decode_step(self, seqs: list[tuple[str, int]]) -> tuple[list[int], torch.Tensor]: ...


@dataclass(frozen=True)
class SeqRows:
    seq_id: str
    num_rows: int  # new tokens of this sequence in the step
    workers: Sequence[int]  # its placement


@dataclass(frozen=True)
class Route:
    """A step's rows per attention worker: (worker, rows or None for all, [(seq_id, n)])."""

    parts: list[tuple[int, slice | torch.Tensor | None, list[tuple[str, int]]]]
    num_rows: int


def _rows_selector(rows: list[int]) -> slice | torch.Tensor:
    # Consecutive rows are a view (no gather, and the frame sends it as it is).
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, dtype=torch.long)


async def _registered_endpoint(store: MetadataStore, w: int) -> tuple[str | None, str | None]:
    """Attention worker w's endpoint in the registry, or (None, why there is none)."""
    try:
        info = await store.get_service("attention", f"attention-{w}")
    except (redis.RedisError, OSError) as exc:
        return None, f"not found: the registry is unreachable ({exc})"
    if info is None:
        return None, "not registered (down or restarting)"
    return info.endpoint, None


def _ended_reader() -> asyncio.Future:
    """The reader of a worker with no link yet: one that has ended, so the first use of
    the worker connects it (`_ensure_connected`)."""
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(None)
    return fut


class AttentionPool:
    def __init__(self, conns: list[transports.Connection | None], partition: str, cfg: ModelConfig,
                 q_early: bool = False, reply_timeout_s: float | None = None,
                 reconnect: Reconnect | None = None, local: Mapping[int, LocalAttention] | None = None) -> None:
        """`local`: workers whose core is in this process (index -> core), attended by a call."""
        self.conns = conns
        self.local = dict(local or {})
        self.local_s = 0.0  # CPU time attending on the local cores
        self.partition = partition
        self.cfg = cfg
        self.q_early = q_early
        self.reply_timeout_s = reply_timeout_s
        self._reconnect = reconnect
        self._reconnecting = [asyncio.Lock() for _ in conns]
        self.kv_heads = [head_range(w, len(conns), cfg.num_kv_heads) for w in range(len(conns))] \
            if partition == "head" else []
        # (worker, tag) -> the future its reply completes.
        self._waiting: dict[tuple[int, Tag], asyncio.Future] = {}
        self._acks: dict[str, list[asyncio.Future]] = {}  # seq_id -> its workers' STORE_KV replies
        self.send_s = 0.0  # time in send calls: a figure for the pipeline's time shares
        # Wall time callers awaited replies (summed over callers: two micro-batches waiting
        # at once count twice), from their last frame sent to their replies in hand.
        self.reply_wait_s = 0.0
        self.reconnects = 0
        self._readers = [asyncio.create_task(self._read(w), name=f"attention-reader-{w}") if c is not None
                         else _ended_reader() for w, c in enumerate(conns)]

    @classmethod
    async def connect(cls, addresses: list[str | None], partition: str, cfg: ModelConfig,
                      tcfg: transports.TransportConfig, q_early: bool = False, reply_timeout_s: float | None = None,
                      reconnect: Reconnect | None = None,
                      local: Mapping[int, LocalAttention] | None = None) -> AttentionPool:
        """One connection per address, in worker order; None: a worker not registered
        now, connected (through `reconnect`) on its first use. The `local` workers get none."""
        conns: list[transports.Connection | None] = []
        try:
            for w, a in enumerate(addresses):
                conns.append(None if a is None or w in (local or {}) else await transports.connect(a, tcfg))
        except BaseException:
            await asyncio.gather(*(c.close() for c in conns if c is not None), return_exceptions=True)
            raise
        return cls(conns, partition, cfg, q_early, reply_timeout_s, reconnect, local)

    @classmethod
    async def from_registry(cls, store: MetadataStore, config: StackConfig, cfg: ModelConfig,
                            local: Mapping[int, LocalAttention] | None = None) -> AttentionPool:
        """Connect to the attention workers registered in Redis, each under its own index,
        once the configured number (`attention.workers`) is there.

        A worker whose connection failed is looked up and connected again on the
        pool's next use of it, so a restarted worker (same index, new endpoint) is
        found without restarting this process; so is a worker that joined the pool
        after it started (an index past `attention.workers`: services/attention_members.py),
        on the first use of that index. Where the registry names no endpoint for it
        (Redis cut off, or its registration lapsed while it could not renew it) the last
        endpoint it was reached at is tried: a worker that is up there serves on."""
        ac = config.attention
        endpoints = await workers_by_index(store, "attention", ac.workers, ac.pool_limit, lambda info: info.endpoint)
        tcfg = config.transport_config()
        last = dict(endpoints)  # each worker's endpoint when it was last connected

        async def reconnect(w: int) -> transports.Connection:
            endpoint, why = await _registered_endpoint(store, w)
            endpoint = endpoint or last.get(w)
            if endpoint is None:
                raise transports.TransportError(f"attention worker {w} is {why}")
            try:
                conn = await asyncio.wait_for(transports.connect(endpoint, tcfg), config.deadlines.health_s)
            except (TimeoutError, OSError, transports.TransportError) as exc:
                if why is None:
                    raise
                raise transports.TransportError(f"attention worker {w} is {why}, and its last endpoint {endpoint} "
                                                f"did not answer: {exc or type(exc).__name__}") from exc
            last[w] = endpoint
            return conn

        size = max(ac.workers, max(endpoints, default=-1) + 1)
        return await cls.connect([endpoints.get(w) for w in range(size)], config.partition, cfg, tcfg,
                                 q_early=config.pipeline.q_early, reply_timeout_s=config.deadlines.reply_s,
                                 reconnect=reconnect, local=local)

    async def close(self) -> None:
        for t in self._readers:
            t.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self.conns if c is not None), return_exceptions=True)
        self._fail_all(transports.TransportError("the attention pool is closed"))

    def _grow(self, size: int) -> None:
        """Room for workers up to index `size - 1`, each with no link yet: its first use
        connects it (a worker that joined the pool after this process started)."""
        if self.partition == "head":
            raise transports.TransportError(f"attention worker {size - 1} is outside the pool of {len(self.conns)} "
                                            "(head-level partitioning has a fixed pool)")
        while len(self.conns) < size:
            self.conns.append(None)
            self._readers.append(_ended_reader())
            self._reconnecting.append(asyncio.Lock())

    async def _ensure_connected(self, w: int) -> None:
        """Connect worker `w` again if its link failed, or for the first time if it joined
        the pool since (one attempt per call; callers fail their step on an error, and
        the scheduler decides what to retry)."""
        if w >= len(self.conns):
            self._grow(w + 1)
        if not self._readers[w].done():
            return
        if self._reconnect is None:
            raise transports.TransportError(f"the connection to attention worker {w} is closed")
        async with self._reconnecting[w]:
            if not self._readers[w].done():
                return  # another caller reconnected it meanwhile
            try:
                conn = await self._reconnect(w)
            except (TimeoutError, OSError, transports.TransportError) as exc:
                raise transports.TransportError(f"attention worker {w} unreachable: {exc}") from exc
            old, self.conns[w] = self.conns[w], conn
            if old is not None:
                await asyncio.gather(old.close(), return_exceptions=True)
            self._readers[w] = asyncio.create_task(self._read(w), name=f"attention-reader-{w}")
            self.reconnects += 1
            log.info("attention worker %d connected again", w)

    async def _drop_link(self, w: int, reason: BaseException) -> None:
        """Give up on worker `w`'s link (it stopped answering): fail whatever still waits
        on it; the next use connects again."""
        reader = self._readers[w]
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        conn = self.conns[w]
        if conn is not None:
            await asyncio.gather(conn.close(), return_exceptions=True)
        self._fail_all(transports.TransportError(str(reason)), worker=w)

    # -- replies ----------------------------------------------------------------------------
    async def _read(self, w: int) -> None:
        conn = self.conns[w]
        assert conn is not None, f"a reader started for attention worker {w}, which has no link"
        try:
            while True:
                frame = await conn.recv()
                try:
                    tag = frame_tag(frame)
                except RemoteError:
                    log.warning("attention worker %d sent a frame without a tag (kind %s); dropped", w, frame.kind)
                    continue
                fut = self._waiting.pop((w, tag), None)
                if fut is None:
                    log.warning("attention worker %d replied to %r, which nobody awaits; dropped", w, tag)
                elif not fut.done():
                    fut.set_result(frame)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 (the link is gone: every waiter on it gets the error and raises it)
            self._fail_all(exc if isinstance(exc, transports.TransportError)
                           else transports.TransportError(f"attention worker {w}: {exc}"), worker=w)

    def _fail_all(self, exc: BaseException, worker: int | None = None) -> None:
        for key in [k for k in self._waiting if worker is None or k[0] == worker]:
            fut = self._waiting.pop(key)
            if not fut.done():
                fut.set_exception(exc)

    def _expect_reply(self, w: int, tag: Tag) -> asyncio.Future:
        key = (w, tag)
        old = self._waiting.get(key)
        if old is not None and not old.done():  # a cancelled wait's reply may never come
            raise RuntimeError(f"tag {tag!r} is already in flight on attention worker {w}")
        fut = asyncio.get_running_loop().create_future()
        self._waiting[key] = fut
        return fut

    @overload
    async def _send(self, w: int, msg: Attend | StoreKV, tag: Tag) -> asyncio.Future: ...

    @overload
    async def _send(self, w: int, msg: Attend | StoreKV, tag: None) -> None: ...

    async def _send(self, w: int, msg: Attend | StoreKV, tag: Tag | None) -> asyncio.Future | None:
        """Send one frame; with a tag, register for its reply first (a fast reply must find it)."""
        await self._ensure_connected(w)
        fut = self._expect_reply(w, tag) if tag is not None else None
        conn = self.conns[w]
        assert conn is not None, "_ensure_connected leaves a link"
        t0 = time.perf_counter()
        try:
            await conn.send(msg.to_frame())
        except BaseException:
            if tag is not None:
                self._waiting.pop((w, tag), None)
            raise
        self.send_s += time.perf_counter() - t0
        return fut

    async def _gather(self, futures: Sequence[asyncio.Future]) -> list[torch.Tensor]:
        # Await every worker's reply before judging any: an error from one must not
        # leave another's reply pending for a tag that is about to be reused.
        frames = await self._replies(futures)
        return [result_tensor(f) for f in frames]

    async def _replies(self, futures: Sequence[asyncio.Future]) -> list[transports.Frame]:
        """The frames answering `futures`, within the reply deadline. A worker that lets
        it pass loses its link (its late replies would answer nobody), and the caller
        gets a TransportError naming it."""
        t0 = time.perf_counter()
        try:
            _, pending = await asyncio.wait(futures, timeout=self.reply_timeout_s)
        finally:
            self.reply_wait_s += time.perf_counter() - t0
        if pending:
            late = sorted({w for (w, _), f in list(self._waiting.items()) if f in pending})
            exc = transports.TransportError(f"attention worker(s) {late} did not answer within "
                                            f"{self.reply_timeout_s:g} s")
            for w in late:
                await self._drop_link(w, exc)
            for f in pending:
                f.cancel()
            raise exc
        for f in futures:
            error = f.exception()
            if error is not None:
                raise error
        return [f.result() for f in futures]

    # -- decode ---------------------------------------------------------------------------
    def route(self, seqs: Sequence[SeqRows]) -> Route:
        """Where a step's rows go; the same for every layer of the step, so made once."""
        members = [(s.seq_id, s.num_rows) for s in seqs]
        if self.partition == "head":
            return Route([(w, None, members) for w in range(len(self.conns))], sum(n for _, n in members))
        parts: list[tuple[int, list[int], list[tuple[str, int]]]] = []
        by_worker: dict[int, int] = {}
        start = 0
        for s in seqs:
            w = s.workers[0]
            if w not in by_worker:
                by_worker[w] = len(parts)
                parts.append((w, [], []))
            _, rows, mem = parts[by_worker[w]]
            rows.extend(range(start, start + s.num_rows))
            mem.append((s.seq_id, s.num_rows))
            start += s.num_rows
        return Route([(w, _rows_selector(rows), mem) for w, rows, mem in parts], start)

    async def attend(self, tag: Tag, layer: int, route: Route, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] -> attention output [T, Hq, D].

        `tag` must be unique among the calls in flight (micro-batch, step, layer).
        """
        futures: list[asyncio.Future] = []
        if self.partition == "head":
            groups = self.cfg.num_groups
            for (w, _, members), (h0, h1) in zip(route.parts, self.kv_heads):
                futures.append(await self._send_attend(w, tag, layer, members, q[:, h0 * groups : h1 * groups],
                                                       k[:, h0:h1], v[:, h0:h1]))
            return torch.cat(await self._gather(futures), dim=1)
        if len(route.parts) == 1:
            w, _, members = route.parts[0]
            if w in self.local:
                return self._attend_here(w, layer, members, q, k, v)
            fut = await self._send_attend(w, tag, layer, members, q, k, v)
            return (await self._gather([fut]))[0]
        for w, rows, members in route.parts:
            if w not in self.local:
                futures.append(await self._send_attend(w, tag, layer, members, q[rows], k[rows], v[rows]))
        # The local parts are computed while the others' frames travel.
        here = {w: self._attend_here(w, layer, members, q[rows], k[rows], v[rows])
                for w, rows, members in route.parts if w in self.local}
        remote = iter(await self._gather(futures) if futures else [])
        outs = [here[w] if w in here else next(remote) for w, _, _ in route.parts]
        if all(isinstance(rows, slice) for _, rows, _ in route.parts):
            return torch.cat(outs)  # rows grouped by worker: the parts are in row order
        out = torch.empty_like(q)
        for (_, rows, _), o in zip(route.parts, outs):
            out[rows] = o
        return out

    def step_here(self, route: Route) -> tuple[LocalAttention, list[tuple[str, int]]] | None:
        """The core in this process holding every row of the step, in the step's row
        order, and the step's (seq_id, new tokens) on it; None where any is elsewhere (a
        caller that then runs a whole step on the core, colocated: `decode_step`)."""
        if self.partition == "head" or len(route.parts) != 1:
            return None
        w, _, members = route.parts[0]  # one part: every row, in order
        return (self.local[w], members) if w in self.local else None

    def attend_here(self, route: Route, device: torch.device | None = None) -> AttendCall | None:
        """A step's attention as a plain call, when all of it is on one core in this
        process (layout colocated): attend(layer, q, k, v) -> out, what `attend` would
        return, with no task switch per layer (the core's `local_step`: the caller
        calls the layers in order with no await between them). None when a part is
        elsewhere. `device`: where the caller's Q, K and V are (default the CPU). A core
        whose native kernels read CPU memory gets them staged through it from another
        device, its output moved back; any other core takes them where they are (a GPU's
        pools and slices: no host round trip) and answers on their device."""
        here = self.step_here(route)
        if here is None:
            return None
        core, members = here
        step = core.local_step(members)
        if core.native and device is not None and device.type != "cpu":
            def staged(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                out = self.timed(step, layer, q.cpu(), k.cpu(), v.cpu())
                return out.to(device, non_blocking=True)

            return staged
        return lambda layer, q, k, v: self.timed(step, layer, q, k, v)

    def _attend_here(self, w: int, layer: int, members: list[tuple[str, int]], q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> torch.Tensor:
        """Attention on a core in this process: what its worker would answer to the frame
        (a refusal raises the same RemoteError), with nothing sent."""
        out, _ = self.timed(lambda: self.local[w].attend(layer, members, q.contiguous(), k.contiguous(),
                                                          v.contiguous(), need_lse=False))
        return out

    def timed(self, call: Callable[..., T], *args: Any) -> T:
        """call(*args), its CPU time in this thread added to `local_s`."""
        t0 = time.thread_time()
        try:
            return call(*args)
        finally:
            self.local_s += time.thread_time() - t0

    async def _send_attend(self, w: int, tag: Tag, layer: int, members: list[tuple[str, int]],
                           q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> asyncio.Future:
        # Frames send contiguous tensors straight from memory (a no-op for row slices).
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if self.q_early:
            await self._send(w, Attend(Kind.ATTEND_Q, tag, layer, members, q=q), None)
            return await self._send(w, Attend(Kind.ATTEND_KV, tag, layer, members, k=k, v=v), tag)
        return await self._send(w, Attend(Kind.ATTEND, tag, layer, members, q, k, v), tag)

    # -- prompt KV --------------------------------------------------------------------------
    async def store_layer(self, seq_id: str, workers: Sequence[int], layer: int, k: torch.Tensor,
                          v: torch.Tensor) -> None:
        """Hand one layer of a prefilled sequence's KV ([P, Hkv, D]) to its workers.

        The last layer registers for each worker's acknowledgement (`wait_stored`)."""
        n = self.cfg.num_layers
        acks: list[asyncio.Future] = []
        for w in workers:
            if self.partition == "head":
                h0, h1 = self.kv_heads[w]
                kk, vv = k[:, h0:h1], v[:, h0:h1]
            else:
                kk, vv = k, v
            msg = StoreKV(seq_id, layer, n, kk, vv)
            if layer == n - 1:
                acks.append(await self._send(w, msg, msg.tag))
            else:
                await self._send(w, msg, None)
        if layer == n - 1:
            self._acks[seq_id] = acks

    def forget_stored(self, seq_id: str) -> None:
        """Stop tracking a sequence whose prefill failed before `wait_stored` (its
        acknowledgements, if any come, are dropped as unawaited)."""
        for fut in self._acks.pop(seq_id, []):
            fut.cancel()

    async def wait_stored(self, seq_id: str) -> None:
        """Await each worker's acknowledgement of a whole sequence's KV."""
        acks = self._acks.pop(seq_id, None)
        if acks is None:
            raise RuntimeError(f"the last layer of {seq_id!r} was not sent")
        for f in await self._replies(acks):
            expect(f, Kind.ACK)
