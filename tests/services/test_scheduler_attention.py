"""The scheduler's attention pool (services/scheduler/scheduler_attention.py) without processes:
reservations, orphaned sequences freed once a worker answers, a restarted worker
followed to its new address. The workers are stand-ins for their control stubs."""

from __future__ import annotations

import asyncio

import grpc

from lamina.services.config import StackConfig
from lamina.services.protos import lamina_pb2
from lamina.services.scheduler.scheduler_attention import AttentionWorkers
from lamina.services.scheduler.scheduler_state import Request


class _Worker:
    """An attention worker's control stub: answers, or fails like an unreachable one."""

    def __init__(self, capacity: int = 100) -> None:
        self.capacity = capacity
        self.answers = True
        self.held: set[str] = set()
        self.frees = 0
        self.retained: list[tuple[list[str], float]] = []

    def _check(self) -> None:
        if not self.answers:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "down")

    async def Stats(self, request: lamina_pb2.Empty, **call: float) -> lamina_pb2.AttentionStats:  # noqa: N802
        self._check()
        return lamina_pb2.AttentionStats(capacity_tokens=self.capacity)

    async def Free(self, request: lamina_pb2.FreeRequest, **call: float) -> lamina_pb2.Empty:  # noqa: N802
        self._check()
        self.frees += 1
        await asyncio.sleep(0)  # in flight a moment, as over the network
        self.held.difference_update(request.seq_ids)
        return lamina_pb2.Empty()

    async def Retain(self, request: lamina_pb2.RetainRequest, **call: float) -> lamina_pb2.RetainReply:  # noqa: N802
        self._check()
        self.retained.append((list(request.seq_ids), request.idle_s))
        freed = sorted(self.held - set(request.seq_ids))
        self.held.intersection_update(request.seq_ids)
        return lamina_pb2.RetainReply(freed=freed)


class _Store:
    def __init__(self) -> None:
        self.services: list = []

    async def list_services(self, kind: str) -> list:
        return self.services


def _pool(workers: list[_Worker], store: _Store | None = None,
          channels: list[tuple[object, str]] | None = None) -> AttentionWorkers:
    def channel(key: object, address: str) -> grpc.aio.Channel:
        if channels is not None:
            channels.append((key, address))
        return grpc.aio.insecure_channel(address)

    pool = AttentionWorkers(StackConfig(redis_url="redis://127.0.0.1:1"), store or _Store(), channel)  # type: ignore[arg-type]
    pool.grow(len(workers))
    for w, worker in enumerate(workers):
        pool.stubs[w], pool.addresses[w], pool.capacity_tokens[w] = worker, f"127.0.0.1:{w + 1}", worker.capacity
        pool.left.discard(w)
    return pool


def _req(rid: str, num_prompt: int, max_tokens: int) -> Request:
    return Request(rid, list(range(num_prompt)), lamina_pb2.SamplingParams(max_tokens=max_tokens), asyncio.Queue())


def test_reservations_follow_placements_and_a_left_worker_gets_none():
    pool = _pool([_Worker(100), _Worker(100), _Worker(100)])
    a, b = _req("a", 10, 30), _req("b", 10, 50)
    assert pool.place(a) and a.workers == [0] and a.reserved == 40
    assert pool.place(b) and b.workers == [1]  # the least reserved
    pool.left.add(2)
    assert pool.num_members == 2
    c = _req("c", 10, 20)
    assert pool.place(c) and c.workers == [0]  # worker 2 left: 0 (40 reserved) is next
    assert pool.reserved_tokens == [70, 60, 0]
    assert not pool.place(_req("d", 10, 60))  # no member has 70 tokens free
    pool.release(a)
    assert pool.reserved_tokens == [30, 60, 0] and a.reserved == 0


async def test_sequences_a_worker_could_not_free_are_freed_when_a_probe_finds_it_answering():
    up, down = _Worker(), _Worker()
    up.held, down.held = {"a"}, {"a"}
    down.answers = False
    pool = _pool([up, down])
    await pool.free([0, 1], ["a"])
    assert up.held == set() and down.held == {"a"} and pool.orphans == {1: {"a"}}
    assert await pool.probe() == [True, False]
    down.answers = True
    frees = down.frees
    assert await asyncio.gather(pool.probe(), pool.probe(), pool.probe()) == [[True, True]] * 3
    assert down.held == set() and pool.orphans == {}
    assert down.frees == frees + 1  # three probes at once (rebuilds): one Free


async def test_retain_tells_each_joined_worker_what_its_requests_hold():
    """The reconciliation: each joined worker gets the sequences requests hold on it (none:
    an empty list) and the idle time; what they freed is counted; one that does not answer
    is told next time."""
    a, b, c = _Worker(), _Worker(), _Worker()
    a.held, b.held, c.held = {"x", "stray"}, {"y"}, {"z"}
    c.answers = False
    pool = _pool([a, b, c])
    assert await pool.retain({0: {"x"}, 1: {"y"}}, 60.0) == 1
    assert a.retained == [(["x"], 60.0)] and b.retained == [(["y"], 60.0)] and c.retained == []
    assert a.held == {"x"} and b.held == {"y"}
    c.answers = True
    assert await pool.retain({0: {"x"}}, 60.0) == 2  # b's "y" (no request holds it now) and c's "z"
    assert b.retained[-1] == ([], 60.0) and c.held == set()


async def test_a_slot_no_worker_joined_is_not_healthy():
    pool = _pool([_Worker()])
    pool.grow(2)
    assert 1 in pool.left and pool.num_members == 1
    assert await pool.probe() == [True, False]
    assert pool.placeable([True, False]) == [100, 0]


async def test_a_probe_follows_a_restarted_worker_to_its_new_address():
    from lamina.kvstore.metadata import ServiceInfo

    store, opened = _Store(), []
    pool = _pool([_Worker(), _Worker()], store, opened)
    store.services = [ServiceInfo("attention", "attention-0", "e", 0.0, {"grpc": "127.0.0.1:1"}),  # unchanged
                      ServiceInfo("attention", "attention-1", "e", 0.0, {"grpc": "127.0.0.1:9"})]  # restarted
    healthy = await pool.probe()
    # The restarted worker's channel, under its key: it replaces (and retires) its old one.
    assert opened == [(("attention", 1), "127.0.0.1:9")] and pool.addresses == ["127.0.0.1:1", "127.0.0.1:9"]
    assert healthy == [True, False]  # nothing listens at the new address
