"""Eviction policies for the prefix cache: pure functions of block statistics.

A policy gets the blocks that may leave a tier (the cache has already removed locked
blocks and, for the last tier, blocks with cached children) and returns the one to
evict. It does no I/O and keeps no state besides the random generator of `random`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStats:
    block_hash: str
    inserted_at: int  # logical clock at first insertion into the cache
    last_access: int  # logical clock at the last lookup hit or insertion
    num_bytes: int


EvictionPolicy = Callable[[Sequence[BlockStats]], str]


def lru(candidates: Sequence[BlockStats]) -> str:
    return min(candidates, key=lambda b: (b.last_access, b.inserted_at, b.block_hash)).block_hash


def fifo(candidates: Sequence[BlockStats]) -> str:
    return min(candidates, key=lambda b: (b.inserted_at, b.block_hash)).block_hash


class RandomPolicy:
    """Uniform choice; seeded so that runs and tests are reproducible."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def __call__(self, candidates: Sequence[BlockStats]) -> str:
        # Sorted first: the candidates' order comes from dict iteration in the caller.
        return self._rng.choice(sorted(b.block_hash for b in candidates))


EVICTION_POLICIES: dict[str, Callable[[int], EvictionPolicy]] = {
    "lru": lambda seed: lru,
    "fifo": lambda seed: fifo,
    "random": lambda seed: RandomPolicy(seed),
}


def make_policy(name: str, seed: int = 0) -> EvictionPolicy:
    try:
        return EVICTION_POLICIES[name](seed)
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; "
                         f"choose one of {sorted(EVICTION_POLICIES)}") from None
