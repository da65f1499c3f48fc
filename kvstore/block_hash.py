"""Chained block hashes for the prefix cache.

The hash of block i covers every token of blocks 0..i: it is computed from the hash of
block i-1 and the tokens of block i. Two prompts therefore share the hash of block i
exactly when they share all tokens up to the end of block i, which is what makes a hash
a valid key for prefix KV (KV of a token depends on all tokens before it).

blake2b, not Python's hash(): keys must be equal across processes and restarts (the
disk tier and the Redis metadata store both use them).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# Parent hash of the first block of every prompt.
ROOT_HASH = "0" * 32


def chain_hash(parent_hash: str, tokens: Sequence[int]) -> str:
    """Hash of one block given its parent's hash; 32 hex characters."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash.encode("ascii"))
    # Fixed-width little-endian token ids: no ambiguity between [1, 23] and [12, 3].
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.hexdigest()


def block_hashes(tokens: Sequence[int], block_size: int) -> list[str]:
    """Chained hashes of the full blocks of `tokens` (a partial last block has none)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[str] = []
    parent = ROOT_HASH
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = chain_hash(parent, tokens[start:start + block_size])
        hashes.append(parent)
    return hashes
