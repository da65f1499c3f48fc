import pytest

from lamina.kvstore.block_hash import ROOT_HASH, block_hashes, chain_hash
from lamina.kvstore.prefix_index import PrefixIndex


def test_chained_hash_covers_all_earlier_tokens():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and len(b) == 2  # the partial last block has no hash
    assert a[1] != b[1]  # same tokens in block 1, different block 0
    assert a[0] == chain_hash(ROOT_HASH, [1, 2, 3, 4])
    assert a[1] == chain_hash(a[0], [5, 6, 7, 8])
    # stable across processes: a fixed value, not Python's salted hash()
    assert chain_hash(ROOT_HASH, [1, 2, 3, 4]) == chain_hash(ROOT_HASH, (1, 2, 3, 4))
    assert chain_hash(ROOT_HASH, [1, 23]) != chain_hash(ROOT_HASH, [12, 3])
    with pytest.raises(ValueError):
        block_hashes([1], 0)


def build(prompts, bs=4):
    idx = PrefixIndex(bs)
    for p in prompts:
        parent = ROOT_HASH
        for i in range(0, len(p) - bs + 1, bs):
            parent = idx.insert(parent, p[i:i + bs])
    return idx


def test_longest_prefix_full_blocks():
    p = list(range(12))
    idx = build([p])
    hs = block_hashes(p, 4)
    m = idx.match(p + [99])
    assert m.block_hashes == tuple(hs) and m.num_tokens == 12 and m.num_partial_tokens == 0
    m = idx.match(p[:8] + [50, 51, 52, 53])
    assert m.block_hashes == tuple(hs[:2]) and m.num_tokens == 8
    assert not idx.match([100, 101, 102, 103]).is_hit


def test_prefix_shorter_than_any_stored_prompt_is_found_at_token_granularity():
    p = list(range(12))
    idx = build([p])
    hs = block_hashes(p, 4)
    m = idx.match(p[:6])  # 1.5 blocks of a 3-block prompt
    assert m.num_tokens == 6 and m.num_partial_tokens == 2
    assert m.block_hashes == (hs[0], hs[1]) and m.num_full_blocks == 1
    m = idx.match([0, 1, 2, 7])  # diverges inside block 0
    assert m.num_tokens == 3 and m.block_hashes == (hs[0],)
    m = idx.match([0, 1])
    assert m.num_tokens == 2


def test_partial_match_picks_the_longest_sibling():
    idx = build([[0, 1, 2, 3, 10, 11, 12, 13], [0, 1, 2, 3, 10, 11, 20, 21]])
    m = idx.match([0, 1, 2, 3, 10, 11, 20])
    assert m.num_tokens == 7
    assert m.block_hashes[1] == chain_hash(m.block_hashes[0], [10, 11, 20, 21])


def test_insert_needs_parent_and_remove_only_leaves():
    idx = PrefixIndex(2)
    assert idx.insert("f" * 32, [1, 2]) is None
    a = idx.insert(ROOT_HASH, [1, 2])
    b = idx.insert(a, [3, 4])
    c = idx.insert(a, [3, 5])
    assert len(idx) == 3 and not idx.is_leaf(a) and idx.parent_of(b) == a
    assert sorted(idx.children_of(a)) == sorted([b, c])
    with pytest.raises(ValueError):
        idx.remove(a)
    idx.remove(b)
    assert idx.match([1, 2, 3, 4]).num_tokens == 3  # partial via c
    assert idx.remove_subtree(a) == [c, a]
    assert len(idx) == 0 and not idx.match([1, 2]).is_hit
