"""Prefetcher: moves the prefixes of the next queued requests up to device ahead of
their prefill, and steers eviction away from blocks an upcoming request needs.

`plan` is pure (which blocks, in which order); `run` applies it to a PrefixCache. The
owner (the prefill service's loop) calls `run` when the queue changes, typically through
`asyncio.to_thread`, so that disk reads overlap the current prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lamina.kvstore.prefix_cache import PrefixCache
from lamina.kvstore.tiers import Tier


@dataclass(frozen=True)
class PrefetchResult:
    num_needed: int  # blocks upcoming requests will use
    num_promoted: int  # moved up to device by this run
    num_on_device: int  # needed blocks on device after the run


class Prefetcher:
    def __init__(self, cache: PrefixCache, lookahead: int = 8) -> None:
        if lookahead <= 0:
            raise ValueError("lookahead must be positive")
        self.cache = cache
        self.lookahead = lookahead

    def plan(self, upcoming: Sequence[Sequence[int]]) -> list[str]:
        """Cached blocks of the next `lookahead` prompts, in queue order, deduplicated."""
        order: list[str] = []
        seen: set[str] = set()
        for tokens in upcoming[:self.lookahead]:
            for h in self.cache.lookup(tokens).block_hashes:
                if h not in seen:
                    seen.add(h)
                    order.append(h)
        return order

    def run(self, upcoming: Sequence[Sequence[int]]) -> PrefetchResult:
        needed = self.plan(upcoming)
        # Protect first: promotions below then evict only blocks nobody upcoming needs.
        self.cache.protect(needed)
        num_promoted = 0
        for h in needed:
            tier = self.cache.tier_of(h)
            if tier in (Tier.HOST, Tier.DISK):
                # Stop at the first block that does not fit: later ones are needed later.
                if not self.cache.promote(h):
                    break
                num_promoted += 1
        on_device = sum(1 for h in needed if self.cache.tier_of(h) == Tier.DEVICE)
        return PrefetchResult(len(needed), num_promoted, on_device)
