"""bench/prefix_cache_cluster.py's bound on what routing can save: unbounded caches, one
for every prompt against one per worker dealt round robin. The stack runs themselves
take minutes and are the benchmark's, not this test's."""

from prefix_cache_cluster import ideal_hit_tokens  # bench/ is on the tests' path (pyproject.toml)

BLOCK = 4


def _conversation(first: int, turns: int) -> list[list[int]]:
    """Each turn repeats the whole previous prompt and adds one block."""
    base = list(range(first, first + BLOCK))
    return [base + [first + 100 + j for j in range(BLOCK * t)] + [7] for t in range(turns)]


def test_one_cache_serves_every_repeated_prefix():
    (a0, a1, a2) = _conversation(0, 3)
    # a1 finds a0's first block; a2 finds a1's two (the last token is always computed)
    assert ideal_hit_tokens([a0, a1, a2], BLOCK) == BLOCK + 2 * BLOCK


def test_round_robin_caches_see_only_their_own_turns():
    (a0, a1, a2) = _conversation(0, 3)
    # worker 0 gets a0 and a2, worker 1 gets a1: a1 finds nothing, a2 finds a0's one block
    assert ideal_hit_tokens([a0, a1, a2], BLOCK, workers=2) == BLOCK
    # interleaved conversations dealt so that each stays on one worker lose nothing
    (b0, b1, b2) = _conversation(1000, 3)
    assert ideal_hit_tokens([a0, b0, a1, b1, a2, b2], BLOCK, workers=2) == 2 * (BLOCK + 2 * BLOCK)
