from kv_helpers import BLOCK_SIZE, block_kv_bytes, make_kv

from lamina.kvstore.block_hash import block_hashes
from lamina.kvstore.prefetch import Prefetcher
from lamina.kvstore.prefix_cache import PrefixCache, PrefixCacheConfig
from lamina.kvstore.tiers import Tier

BS, BLOCK = BLOCK_SIZE, block_kv_bytes()


def prompt(seed, n):
    return [seed * 1000 + i for i in range(n * BS)]


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
    result = pf.run([a + [5], [9, 9, 9, 9]])
    assert result.num_needed == 2 and result.num_promoted == 2 and result.num_on_device == 2
    assert c.tier_distance(a) == 0 and c.num_blocks(Tier.DEVICE) == 3
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
    result = Prefetcher(c).run([b, a])
    # b (first in the queue) stays on device; a cannot displace it
    assert result.num_promoted == 0 and c.tier_distance(b) == 0 and c.tier_distance(a) == 1
    result = Prefetcher(c).run([a])
    assert result.num_promoted == 1 and c.tier_distance(a) == 0
