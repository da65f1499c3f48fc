import threading
import time

import pytest
import torch
from kv_helpers import BLOCK_SIZE, block_kv_bytes, make_kv

from lamina.kvstore.block_hash import block_hashes
from lamina.kvstore.prefix_cache import PrefixCache, PrefixCacheConfig
from lamina.kvstore.quant import QuantizedTensor
from lamina.kvstore.tiers import Tier

BS = BLOCK_SIZE
BLOCK = block_kv_bytes()


def prompt(seed: int, num_blocks: int, extra: int = 0) -> list[int]:
    return [seed * 1000 + i for i in range(num_blocks * BS + extra)]


def cache(tmp_path=None, device=2, host=0, disk=0, **kw) -> PrefixCache:
    return PrefixCache(PrefixCacheConfig(
        block_size=BS, device_bytes=device * BLOCK, host_bytes=host * BLOCK,
        disk_bytes=disk * 2 * BLOCK, disk_dir=str(tmp_path / "kv") if disk else None, **kw))


def tiers(c, tokens):
    return [c.tier_of(h) for h in block_hashes(tokens, BS)]


def test_config_validation():
    with pytest.raises(ValueError, match="disk_dir"):
        PrefixCacheConfig(block_size=4, device_bytes=10, disk_bytes=10)
    with pytest.raises(ValueError, match="eviction"):
        PrefixCacheConfig(block_size=4, device_bytes=10, eviction="mru")


def test_insert_then_acquire_device_hit_exact_kv():
    c = cache(device=4)
    p = prompt(1, 3, extra=2)
    kv = make_kv(len(p))
    assert c.insert(p, kv) == 3  # partial last block not stored
    assert c.tier_distance(p) == 0
    with c.acquire(p + [7, 8]) as h:
        assert h.num_tokens == 12 and torch.equal(h.kv, kv[:, :, :12])
    assert c.insert(p, kv) == 0  # already cached
    assert c.tier_distance([5, 5, 5, 5]) == 3
    miss = c.acquire([5, 5, 5, 5])
    assert miss.num_tokens == 0 and miss.kv is None


def test_partial_block_hit():
    c = cache(device=4)
    p = prompt(1, 3)
    kv = make_kv(len(p))
    c.insert(p, kv)
    with c.acquire(p[:6] + [-1, -2]) as h:
        assert h.num_tokens == 6 and torch.equal(h.kv, kv[:, :, :6])
    assert c.stats.hit_tokens_by_tier["device"] == 6


def test_swap_down_one_tier_at_a_time_and_up_straight_to_device(tmp_path):
    c = cache(tmp_path, device=2, host=2, disk=8)
    a, b, d = prompt(1, 2), prompt(2, 2), prompt(3, 2)
    kva, kvb, kvd = make_kv(8, 1), make_kv(8, 2), make_kv(8, 3)
    c.insert(a, kva)
    c.insert(b, kvb)  # a -> host
    assert tiers(c, a) == [Tier.HOST, Tier.HOST] and tiers(c, b) == [Tier.DEVICE] * 2
    c.insert(d, kvd)  # b -> host, a -> disk (LRU)
    assert tiers(c, a) == [Tier.DISK] * 2 and tiers(c, b) == [Tier.HOST] * 2
    assert c.tier_distance(a) == 2 and c.tier_distance(b) == 1
    assert c.stats.num_demotions == {"host": 4, "disk": 2}
    with c.acquire(a) as h:  # disk -> device directly; d goes down to host
        assert torch.equal(h.kv, kva)
        assert tiers(c, a) == [Tier.DEVICE] * 2 and tiers(c, d) == [Tier.HOST] * 2
    assert c.stats.num_promotions == {"host": 0, "disk": 2}
    assert c.stats.hit_tokens_by_tier == {"device": 0, "host": 0, "disk": 8}
    assert tiers(c, b) == [Tier.DISK] * 2
    assert c.used_bytes(Tier.DEVICE) == 2 * BLOCK


def test_locked_blocks_are_not_evicted():
    c = cache(device=2)
    a = prompt(1, 2)
    c.insert(a, make_kv(8))
    with c.acquire(a):
        assert c.insert(prompt(2, 1), make_kv(4)) == 0  # nothing may leave
        assert tiers(c, a) == [Tier.DEVICE] * 2
    assert c.insert(prompt(2, 1), make_kv(4)) == 1  # released: a leaf of a is dropped
    assert c.lookup(a).num_tokens == 4


def test_only_leaves_are_dropped_and_policies_differ():
    for policy, survivor in (("lru", "a"), ("fifo", "b")):
        c = cache(device=2, eviction=policy)
        a, b = prompt(1, 1), prompt(2, 1)
        c.insert(a, make_kv(4))
        c.insert(b, make_kv(4))
        c.acquire(a).release()  # a recently used
        c.insert(prompt(3, 1), make_kv(4))
        kept = {"a": c.lookup(a).is_hit, "b": c.lookup(b).is_hit}
        assert kept == {"a": survivor == "a", "b": survivor == "b"}, policy
    c = cache(device=2)
    p = prompt(1, 2)
    c.insert(p, make_kv(8))
    c.acquire(p[:4]).release()  # block 0 newer than block 1, but block 1 is the leaf
    c.insert(prompt(2, 1), make_kv(4))
    assert c.lookup(p).num_tokens == 4 and c.num_blocks() == 2


def test_disk_tier_survives_restart(tmp_path):
    c = cache(tmp_path, device=1, host=1, disk=8)
    p = prompt(1, 3)
    kv = make_kv(12)
    c.insert(p, kv)
    c.insert(prompt(2, 2), make_kv(8))  # pushes p down to disk
    assert tiers(c, p) == [Tier.DISK] * 3
    del c
    (tmp_path / "kv" / "junk.tmp").write_bytes(b"x")
    c2 = cache(tmp_path, device=1, host=1, disk=8)
    assert c2.lookup(p).num_tokens == 12 and c2.tier_distance(p) == 2
    assert not (tmp_path / "kv" / "junk.tmp").exists()
    # device holds 1 block: the prefix is cut where the next block cannot fit
    with c2.acquire(p) as h:
        assert h.num_tokens == 4 and torch.equal(h.kv, kv[:, :, :4])
    c3 = cache(tmp_path, device=4, host=1, disk=8)
    with c3.acquire(p) as h:
        assert h.num_tokens == 12 and torch.equal(h.kv, kv)


def test_quantized_lower_tiers(tmp_path):
    # A 512-byte block quantizes to 96 bytes (group 32): the host holds exactly one.
    c = PrefixCache(PrefixCacheConfig(
        block_size=BS, device_bytes=3 * BLOCK, host_bytes=100, disk_bytes=8 * BLOCK,
        disk_dir=str(tmp_path / "kv"), quantize_4bit=True, quant_group_size=32))
    p = prompt(1, 3)
    kv = make_kv(12)
    c.insert(p, kv)
    c.insert(prompt(2, 1), make_kv(4))
    c.insert(prompt(3, 1), make_kv(4))
    hs = block_hashes(p, BS)
    assert tiers(c, p) == [Tier.DISK, Tier.HOST, Tier.DEVICE]
    assert isinstance(c._tiers[Tier.HOST].get(hs[1]), QuantizedTensor)
    assert c.used_bytes(Tier.HOST) == 96
    with c.acquire(p) as h:
        assert h.num_tokens == 12
        err = (h.kv - kv).abs()
        span = kv.max() - kv.min()
        assert err[:, :, 8:].max() == 0  # the device block is exact
        assert 0 < err.max() <= span / 30 + 1e-5


def test_single_flight_transfer(tmp_path):
    c = cache(tmp_path, device=4, host=0, disk=8)
    p = prompt(1, 1)
    kv = make_kv(4)
    c.insert(p, kv)
    c.insert(prompt(2, 4), make_kv(16))  # p -> disk
    assert c.tier_distance(p) == 2
    disk = c._tiers[Tier.DISK]
    real_read, reads, started, go = disk.read, [], threading.Event(), threading.Event()

    def slow_read(h):
        reads.append(h)
        started.set()
        assert go.wait(10)
        return real_read(h)

    disk.read = slow_read
    results = []
    t1 = threading.Thread(target=lambda: results.append(c.acquire(p)))
    t2 = threading.Thread(target=lambda: results.append(c.acquire(p)))
    t1.start()
    assert started.wait(10)
    t2.start()
    entry = c._entries[block_hashes(p, BS)[0]]
    deadline = time.monotonic() + 10
    while not entry.loading._condition._waiters:  # t2 waits on t1's transfer
        assert time.monotonic() < deadline
        time.sleep(0.001)
    go.set()
    t1.join(10)
    t2.join(10)
    assert len(reads) == 1 and c.stats.num_promotions["disk"] == 1
    assert len(results) == 2 and all(torch.equal(h.kv, kv) for h in results)
    assert entry.lock_count == 2
    for h in results:
        h.release()
    assert entry.lock_count == 0


def test_events_report_changes(tmp_path):
    events = []
    c = PrefixCache(PrefixCacheConfig(block_size=BS, device_bytes=BLOCK), on_event=events.append)
    a, b = prompt(1, 1), prompt(2, 1)
    c.insert(a, make_kv(4))
    c.insert(b, make_kv(4))
    ha, hb = block_hashes(a, BS)[0], block_hashes(b, BS)[0]
    assert events == [("stored", ha, Tier.DEVICE), ("dropped", ha, Tier.DEVICE),
                      ("stored", hb, Tier.DEVICE)]
    assert [r[:3] for r in c.block_records()] == [(hb, Tier.DEVICE, BLOCK)]


def test_promotion_passes_a_host_tier_full_of_the_blocks_being_promoted(tmp_path):
    """Device full of another prompt's blocks, host holding exactly the two blocks being
    acquired (locked while they come up): the device's victims go past host to disk, and
    the hit is whole (it used to come back empty)."""
    c = cache(tmp_path, device=4, host=2, disk=16)
    a, b = prompt(1, 2), prompt(2, 4)
    kv_a = make_kv(len(a))
    c.insert(a, kv_a)
    c.insert(b, make_kv(len(b), seed=1))  # a's blocks go down to host
    assert tiers(c, a) == [Tier.HOST, Tier.HOST] and tiers(c, b) == [Tier.DEVICE] * 4
    with c.acquire(a + [9]) as h:
        assert h.num_tokens == len(a) and torch.equal(h.kv, kv_a)
    assert tiers(c, a) == [Tier.DEVICE, Tier.DEVICE]
    # b's first block went past the full host to disk; once a's blocks left host, the next went there.
    assert tiers(c, b) == [Tier.DISK, Tier.HOST, Tier.DEVICE, Tier.DEVICE]


def test_read_takes_blocks_from_their_tiers_and_moves_none(tmp_path):
    # Host room for one 4-bit block (about a sixth of a full one), so the third goes to disk.
    c = PrefixCache(PrefixCacheConfig(block_size=BS, device_bytes=BLOCK, host_bytes=BLOCK // 5, disk_bytes=32 * BLOCK,
                                      disk_dir=str(tmp_path / "kv"), quantize_4bit=True))
    p = prompt(1, 3)
    kv = make_kv(len(p))
    c.insert(p, kv)
    where = tiers(c, p)
    assert set(where) == {Tier.DEVICE, Tier.HOST, Tier.DISK}
    n, got = c.read(p + [5])
    assert n == len(p) and got.shape == kv.shape
    assert tiers(c, p) == where and c.stats.num_hit_tokens == 0
    # Device is exact; host and disk hold 4-bit blocks, read back dequantized.
    device_block = where.index(Tier.DEVICE)
    sl = slice(device_block * BS, (device_block + 1) * BS)
    assert torch.equal(got[:, :, sl], kv[:, :, sl])
    assert torch.allclose(got, kv, atol=0.5)  # 4-bit steps of randn groups: (max - min) / 15
    assert c.read([7] * BS) == (0, None)
