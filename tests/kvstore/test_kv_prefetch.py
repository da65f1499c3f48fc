import threading

from kv_helpers import BLOCK_SIZE, block_kv_bytes, make_kv

from lamina.kvstore.block_hash import block_hashes
from lamina.kvstore.prefetch import Prefetcher
from lamina.kvstore.prefix_cache import PrefixCache, PrefixCacheConfig
from lamina.kvstore.tiers import Tier

BS, BLOCK = BLOCK_SIZE, block_kv_bytes()


def prompt(seed, n):
    return [seed * 1000 + i for i in range(n * BS)]


def keyed(*prompts):
    return list(enumerate(prompts))


def test_prefetch_moves_upcoming_prefixes_up_and_evicts_the_unneeded(tmp_path):
    c = PrefixCache(PrefixCacheConfig(block_size=BS, device_bytes=3 * BLOCK,
                                      host_bytes=2 * BLOCK, disk_bytes=20 * BLOCK,
                                      disk_dir=str(tmp_path)))
    a, b, d = prompt(1, 2), prompt(2, 2), prompt(3, 2)
    for i, p in enumerate((a, b, d)):
        c.insert(p, make_kv(8, i))
    assert c.tier_distance(a) == 2 and c.tier_distance(d) == 0
    pf = Prefetcher(c, lookahead=2)
    assert pf.plan([a + [5], [9, 9, 9, 9], b]) == block_hashes(a, BS)
    result = pf.run(keyed(a + [5], [9, 9, 9, 9], b))
    assert result.num_needed == 2 and result.num_promoted == 2 and result.num_on_device == 2
    assert c.tier_distance(a) == 0 and c.num_blocks(Tier.DEVICE) == 3
    assert c.tier_distance(b) == 2  # past the lookahead: neither moved nor protected
    assert pf.num_requests == 1 and not any(c.is_protected(h) for h in block_hashes(b, BS))  # [9, 9, 9, 9]: no hit
    # a's blocks are the least recently used on device, yet a new block displaces the
    # unneeded third block instead: the prefetcher protects what the queue needs.
    c.insert(prompt(4, 1), make_kv(4))
    assert c.tier_distance(a) == 0
    assert c.tier_distance(prompt(4, 1)) == 0


def test_prefetch_never_evicts_needed_blocks_for_other_needed_blocks(tmp_path):
    c = PrefixCache(PrefixCacheConfig(block_size=BS, device_bytes=1 * BLOCK,
                                      host_bytes=4 * BLOCK))
    a, b = prompt(1, 1), prompt(2, 1)
    c.insert(a, make_kv(4))
    c.insert(b, make_kv(4))  # a -> host
    pf = Prefetcher(c)
    result = pf.run(keyed(b, a))
    # b (first in the queue) stays on device; a cannot displace it
    assert result.num_promoted == 0 and c.tier_distance(b) == 0 and c.tier_distance(a) == 1
    assert pf.run([(1, a)]).num_promoted == 0  # b's request (key 0) still waits: its block stays
    pf.release(0)  # b's request took its prefix
    result = pf.run([(1, a)])
    assert result.num_promoted == 1 and c.tier_distance(a) == 0 and c.tier_distance(b) == 1


def test_protection_is_counted_and_an_insert_never_takes_a_protected_block_off_device():
    c = PrefixCache(PrefixCacheConfig(block_size=BS, device_bytes=1 * BLOCK, host_bytes=4 * BLOCK))
    a, b, d, e = prompt(1, 1), prompt(2, 1), prompt(3, 1), prompt(4, 1)
    c.insert(a, make_kv(4))
    (h,) = block_hashes(a, BS)
    c.protect([h])
    c.protect([h])  # two waiting requests need it
    # No room on device but a's: b is stored a tier down, as a demotion would store it.
    assert c.insert(b, make_kv(4)) == 1
    assert c.tier_of(h) == Tier.DEVICE and c.tier_distance(b) == 1
    c.unprotect([h])
    assert c.is_protected(h) and c.insert(d, make_kv(4)) == 1 and c.tier_distance(d) == 1  # one still waits
    c.unprotect([h])
    c.unprotect([h])  # one too many: nothing to end
    assert not c.is_protected(h)
    assert c.insert(e, make_kv(4)) == 1 and c.tier_of(h) == Tier.HOST and c.tier_distance(e) == 0
    # The request being prefilled comes first: its acquire may move a protected block down.
    c.protect(block_hashes(e, BS))
    with c.acquire(a) as hit:
        assert hit.num_tokens == BS
    assert c.tier_distance(a) == 0 and c.tier_distance(e) == 1


def test_a_released_request_keeps_the_blocks_another_waiting_request_shares():
    c = PrefixCache(PrefixCacheConfig(block_size=BS, device_bytes=2 * BLOCK, host_bytes=8 * BLOCK))
    shared = prompt(1, 1)
    a, b = shared + prompt(2, 1), shared + prompt(3, 1)
    c.insert(a, make_kv(8))
    c.insert(b, make_kv(8, 1))
    pf = Prefetcher(c)
    pf.run(keyed(a, b))
    first = block_hashes(shared, BS)[0]
    pf.release(0)
    assert c.is_protected(first)  # b needs it too
    assert not any(c.is_protected(h) for h in block_hashes(a, BS)[1:])
    pf.release(1)
    assert not c.is_protected(first) and pf.num_requests == 0
    pf.release(1)  # released twice: nothing happens


def test_a_run_adds_blocks_cached_since_the_last_and_ends_when_asked():
    c = PrefixCache(PrefixCacheConfig(block_size=BS, device_bytes=3 * BLOCK, host_bytes=8 * BLOCK))
    a = prompt(1, 3)
    hashes = block_hashes(a, BS)
    c.insert(a[:BS], make_kv(4))
    pf = Prefetcher(c)
    pf.run([("a", a)])
    assert c.is_protected(hashes[0]) and not c.is_protected(hashes[1])
    c.insert(a, make_kv(12))  # an earlier prompt of its conversation computed the rest
    c.insert(prompt(2, 2), make_kv(8))  # and another pushed it down, but for the protected block
    assert [c.tier_of(h) for h in hashes] == [Tier.DEVICE, Tier.HOST, Tier.HOST]
    stop = threading.Event()
    stop.set()
    result = pf.run([("a", a)], stop)
    assert result.num_promoted == 0 and all(c.is_protected(h) for h in hashes)
    result = pf.run([("a", a)])
    assert result.num_promoted == 2 and [c.tier_of(h) for h in hashes] == [Tier.DEVICE] * 3
    pf.release("a")
    assert not any(c.is_protected(h) for h in hashes)


def test_a_new_block_with_no_device_room_but_protected_blocks_goes_to_disk_whole(tmp_path):
    """No host tier: the block is written to disk with its header, so a restart finds it."""
    c = PrefixCache(PrefixCacheConfig(block_size=BS, device_bytes=1 * BLOCK, disk_bytes=8 * (BLOCK + 4096),
                                      disk_dir=str(tmp_path), quantize_4bit=True, quant_group_size=4))
    a, b = prompt(1, 1), prompt(2, 2)
    c.insert(a, make_kv(4))
    c.protect(block_hashes(a, BS))
    kv = make_kv(8, 1)
    assert c.insert(b, kv) == 2 and c.tier_distance(b) == 2 and c.tier_distance(a) == 0
    again = PrefixCache(PrefixCacheConfig(block_size=BS, device_bytes=1 * BLOCK, disk_bytes=8 * (BLOCK + 4096),
                                          disk_dir=str(tmp_path), quantize_4bit=True, quant_group_size=4))
    n, read = again.read(b)
    assert n == 2 * BS and read is not None
    assert (read - kv).abs().max() < 0.5  # 4-bit, as a demotion would have written it
