"""The scheduler's attention pool: membership, probing, orphaned sequences, KV reservations.

`AttentionWorkers` owns, for each attention worker index (one slot per index up to the
highest seen; the lists grow together and never shrink): its control stub and gRPC
address, its KV capacity and the tokens reserved on it, whether it is out of the pool,
and the sequences still to free on it. It decides nothing itself: who joins or leaves
is `attention_members.membership`, where a request goes is `placement.place_request`,
what is open to placement is `placement.placeable` (pure functions, tested alone).

What must hold:
- `reserved_tokens[w]` is the sum of `reserved` over the requests placed on `w`:
  `place` adds a request's reservation to each of its workers, `release` takes it back
  once, so a request admitted now can always finish without running out of KV.
- A slot whose worker left the pool (its registration ended) or never joined is in
  `left`: no new request is placed there, but its stub stays, so what requests still
  hold on it can be freed and a step to it fails like any lost worker's.
- A sequence whose Free did not reach its worker is kept in `orphans[w]` until `w`
  answers a later Free (tried every half service TTL, and at each probe): KV is never
  leaked on a worker that comes back.
- What no Free can name (a prompt's KV that a partition held back until after its
  request's Free, a store cut off halfway) is reclaimed by `retain`: every half service
  TTL each worker is told the sequences requests hold on it and frees any other it has
  not touched for `deadlines.kv_reclaim_s`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable, Sequence

import grpc

from lamina.kvstore.metadata import REDIS_ERRORS, MetadataStore
from lamina.services.attention_members import membership, worker_index
from lamina.services.config import StackConfig
from lamina.services.placement import place_request, placeable
from lamina.services.protos import lamina_pb2, lamina_pb2_grpc
from lamina.services.scheduler.scheduler_state import Request

log = logging.getLogger(__name__)

# channel(key, address): a channel to a peer at an address, replacing the peer's before it
# (lamina.services.channels.Channels.open)
ChannelFactory = Callable[[Hashable, str], grpc.aio.Channel]


class AttentionWorkers:
    def __init__(self, config: StackConfig, store: MetadataStore, channel: ChannelFactory) -> None:
        self._config = config
        self._store = store
        self._channel = channel
        self.stubs: list[lamina_pb2_grpc.AttentionControlStub | None] = []
        self.addresses: list[str] = []  # each worker's gRPC address in use
        self.capacity_tokens: list[int] = []
        # Tokens reserved on each worker: prompt + max_tokens of every request placed there.
        self.reserved_tokens: list[int] = []
        # Pool members whose registration is gone (stopped, or never registered below the
        # highest index): no new request is placed there (services/attention_members.py).
        self.left: set[int] = set()
        # Sequences to free on a worker once it answers again (it did not when their
        # requests were freed or moved away).
        self.orphans: dict[int, set[str]] = {}

    @property
    def num_members(self) -> int:
        """Workers requests are placed on."""
        return len(self.stubs) - len(self.left)

    # -- membership -------------------------------------------------------------------------
    def grow(self, size: int) -> None:
        """Room for workers up to index `size - 1`; a new slot is out of the pool until its
        worker joins."""
        while len(self.stubs) < size:
            self.left.add(len(self.stubs))
            self.stubs.append(None)
            self.addresses.append("")
            self.capacity_tokens.append(0)
            self.reserved_tokens.append(0)

    async def join(self, w: int, address: str, timeout_s: float) -> None:
        """Put worker `w`, at gRPC `address`, in the pool with the KV capacity it reports;
        raises the Stats call's error when it does not answer."""
        stub = self._control(w, address)
        stats = await stub.Stats(lamina_pb2.Empty(), timeout=timeout_s)
        self.grow(w + 1)
        self.stubs[w], self.addresses[w] = stub, address
        self.capacity_tokens[w] = stats.capacity_tokens
        self.left.discard(w)

    async def refresh(self) -> None:
        """Bring the pool in line with the registered attention workers: one that
        registered (a new index up to attention.max_workers, or a left one back) joins
        once it answers Stats, one whose registration is gone leaves (its requests stay
        until a step to it fails; then they are rebuilt like any worker's)."""
        infos = await self._store.list_services("attention")
        present = {w: a for w, a in enumerate(self.addresses) if w not in self.left}
        change = membership(present, [(i.service_id, i.meta.get("grpc", "")) for i in infos],
                            self._config.attention.pool_limit)
        for w in sorted(change.left):
            self.left.add(w)
            log.info("attention worker %d left the pool (its registration ended)", w)
        for w, address in change.joined.items():
            try:
                await self.join(w, address, self._config.deadlines.health_s)
            except grpc.aio.AioRpcError as exc:
                log.info("attention worker %d at %s registered but does not answer yet (%s)", w, address,
                         exc.code().name)
                continue
            log.info("attention worker %d is in the pool at %s (%d tokens of KV)", w, address,
                     self.capacity_tokens[w])

    # -- probing ----------------------------------------------------------------------------
    async def probe(self) -> list[bool]:
        """Which workers answer now, by index. Re-reads their registrations, so a
        restarted worker is reached at its new address; frees orphans on those that answer."""
        timeout_s = self._config.deadlines.health_s
        await self._follow_addresses()
        stats = await asyncio.gather(*(stub.Stats(lamina_pb2.Empty(), timeout=timeout_s) if stub is not None
                                       else _no_worker(w) for w, stub in enumerate(self.stubs)),
                                     return_exceptions=True)
        return [not isinstance(st, BaseException) and await self._free_orphans(w) for w, st in enumerate(stats)]

    async def free_orphans(self) -> None:
        """Free orphans on every worker that answers now (the scheduler calls this every
        half service TTL: a worker back from a partition holds no dead KV for long)."""
        await asyncio.gather(*(self._free_orphans(w) for w, ids in list(self.orphans.items())
                               if ids and self.stubs[w] is not None))

    async def _free_orphans(self, w: int) -> bool:
        """Free the sequences worker `w` still holds of requests freed or moved while it
        did not answer; False when it does not answer now either."""
        # Taken out while the Free is in flight: the probes of several rebuilds at once
        # would each send it (and log it) again.
        seq_ids = sorted(self.orphans.pop(w, ()))
        if not seq_ids:
            return True
        try:
            await self._stub(w).Free(lamina_pb2.FreeRequest(seq_ids=seq_ids), timeout=self._config.deadlines.health_s)
        except grpc.aio.AioRpcError:
            self.orphans.setdefault(w, set()).update(seq_ids)
            return False
        log.info("freed %d sequences left on attention worker %d while it did not answer", len(seq_ids), w)
        return True

    async def _follow_addresses(self) -> None:
        """Move the stub of each joined worker registered at a new address (it restarted)
        to that address."""
        try:
            infos = await self._store.list_services("attention")
        except REDIS_ERRORS as exc:
            # The probe goes on at the addresses known: a worker that did not restart answers there.
            log.debug("attention registrations not read (%s); probing the known addresses", exc)
            return
        for info in infos:
            w, address = worker_index(info.service_id), info.meta.get("grpc")
            if w is not None and w < len(self.stubs) and self.stubs[w] is not None \
                    and address and address != self.addresses[w]:
                self.addresses[w] = address
                self.stubs[w] = self._control(w, address)

    # -- reservations -----------------------------------------------------------------------
    def placeable(self, healthy: Sequence[bool] | None = None) -> list[int]:
        """Each worker's KV capacity open to new requests (0 out of the pool, or not
        `healthy` when a probe's answers are given)."""
        return placeable(self.capacity_tokens, self.left, healthy)

    def place(self, req: Request, capacity: Sequence[int] | None = None) -> bool:
        """Reserve room for the request's KV (its choices' included) on workers with
        room (of `capacity`, default `placeable()`); False when none has it now."""
        need = req.reserve_tokens
        workers = place_request(self._config.partition, self.reserved_tokens, capacity or self.placeable(), need)
        if workers is None:
            return False
        req.workers, req.reserved = workers, need
        for w in workers:
            self.reserved_tokens[w] += need
        return True

    def release(self, req: Request) -> None:
        """Give back what `req` reserved on its workers (its `workers` stay as they are)."""
        for w in req.workers:
            self.reserved_tokens[w] -= req.reserved
        req.reserved = 0

    # -- sequences on the workers -----------------------------------------------------------
    async def fork(self, workers: Sequence[int], request: lamina_pb2.ForkRequest) -> None:
        """Fork a prompt's KV on each of `workers`; raises the first failed call's error."""
        await asyncio.gather(*(self._stub(w).Fork(request, timeout=self._config.deadlines.rpc_s)
                               for w in workers))

    async def free(self, workers: Sequence[int], seq_ids: list[str]) -> None:
        """Free sequences on `workers`; a worker that does not answer keeps them as
        orphans, freed when a probe finds it answering again."""
        results = await asyncio.gather(*(self._stub(w).Free(
            lamina_pb2.FreeRequest(seq_ids=seq_ids), timeout=self._config.deadlines.health_s)
            for w in workers), return_exceptions=True)
        for w, r in zip(workers, results):
            if isinstance(r, BaseException):
                self.orphans.setdefault(w, set()).update(seq_ids)

    async def retain(self, live: dict[int, set[str]], idle_s: float) -> int:
        """Tell each joined worker the sequences requests hold on it (`live`, by index):
        it frees the others untouched for `idle_s`. The number freed (a worker that does
        not answer is told next time)."""
        joined = [w for w, stub in enumerate(self.stubs) if stub is not None]
        replies = await asyncio.gather(*(self._stub(w).Retain(
            lamina_pb2.RetainRequest(seq_ids=sorted(live.get(w, ())), idle_s=idle_s),
            timeout=self._config.deadlines.health_s) for w in joined), return_exceptions=True)
        freed = 0
        for w, reply in zip(joined, replies):
            if not isinstance(reply, BaseException) and reply.freed:
                freed += len(reply.freed)
                log.warning("attention worker %d freed %d sequence(s) no request held", w, len(reply.freed))
        return freed

    async def free_everywhere(self, seq_ids: list[str]) -> None:
        """Free sequences on every joined worker, whichever holds them; a worker that
        does not answer is not asked again."""
        await asyncio.gather(*(stub.Free(lamina_pb2.FreeRequest(seq_ids=seq_ids), timeout=self._config.deadlines.rpc_s)
                               for stub in self.stubs if stub is not None), return_exceptions=True)

    def _control(self, w: int, address: str) -> lamina_pb2_grpc.AttentionControlStub:
        """A control stub of worker `w` at `address`, on a new channel that replaces its last."""
        return lamina_pb2_grpc.AttentionControlStub(self._channel(("attention", w), address))

    def _stub(self, w: int) -> lamina_pb2_grpc.AttentionControlStub:
        """The stub of a worker that holds a request's KV (it joined the pool before)."""
        stub = self.stubs[w]
        assert stub is not None, f"attention worker {w} has never joined the pool"
        return stub


async def _no_worker(w: int) -> None:
    """Stats of a pool slot with no worker: fails like an unreachable one."""
    raise ConnectionError(f"attention worker {w} has not joined the pool")
