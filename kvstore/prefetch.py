"""Prefetcher: moves the prefixes of the next queued requests up to device ahead of
their prefill, and steers eviction away from blocks an upcoming request needs.

`plan` is pure (which blocks, in which order); `run` applies it to a PrefixCache. The
owner (the prefill service's batch loop) calls `run` while a forward computes, through
`asyncio.to_thread`, so that disk reads overlap the current prefill.

Protection is per request: `run` protects each named request's cached blocks under the
request's key until `release(key)`, which the owner calls once that request has taken its
prefix (`PrefixCache.acquire`: its handle locks the blocks from then on). A block two
waiting requests need stays protected until both are released (`PrefixCache.protect`
counts).

Thread safety: `run` may run on a worker thread while the owner calls `release` on its
own; the cache is thread-safe, and the key map is guarded by `_lock` (taken before the
cache's lock, never after). The owner releases a key only when no run naming it is in
flight or to come: a release that came first would leave that run's protection behind.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable, Sequence
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
        self._lock = threading.Lock()
        self._protected: dict[Hashable, tuple[str, ...]] = {}  # request key -> the blocks protected for it

    def plan(self, upcoming: Sequence[Sequence[int]]) -> list[str]:
        """Cached blocks of the next `lookahead` prompts, in queue order, deduplicated."""
        return _in_order(self.cache.lookup(tokens).block_hashes for tokens in upcoming[:self.lookahead])

    def run(self, upcoming: Sequence[tuple[Hashable, Sequence[int]]],
            stop: threading.Event | None = None) -> PrefetchResult:
        """Protects the cached blocks of the next `lookahead` requests ((key, prompt) in
        queue order), then moves those on host or disk to device in that order, up to
        the first that does not fit, or until `stop` is set (checked between blocks)."""
        window = upcoming[:self.lookahead]
        # Protect first: promotions below then evict only blocks nobody upcoming needs.
        matched: list[tuple[str, ...]] = []
        with self._lock:
            for key, tokens in window:
                hashes = self.cache.lookup(tokens).block_hashes
                held = self._protected.get(key, ())
                # A block cached since the last run (an earlier prompt computed it) is added.
                is_held = set(held)
                new = tuple(h for h in hashes if h not in is_held)
                if new:
                    self.cache.protect(new)
                    self._protected[key] = held + new
                matched.append(hashes)
        needed = _in_order(matched)
        num_promoted = 0
        for h in needed:
            if stop is not None and stop.is_set():
                break
            if self.cache.tier_of(h) in (Tier.HOST, Tier.DISK):
                # Stop at the first block that does not fit: later ones are needed later.
                if not self.cache.promote(h):
                    break
                num_promoted += 1
        on_device = sum(1 for h in needed if self.cache.tier_of(h) == Tier.DEVICE)
        return PrefetchResult(len(needed), num_promoted, on_device)

    def release(self, key: Hashable) -> None:
        """Ends the protection `run` gave request `key` (nothing when it gave none)."""
        with self._lock:
            self.cache.unprotect(self._protected.pop(key, ()))

    @property
    def num_requests(self) -> int:
        """Requests whose blocks are protected (named by a run, not yet released)."""
        with self._lock:
            return len(self._protected)


def _in_order(hash_lists: Iterable[Sequence[str]]) -> list[str]:
    order: list[str] = []
    seen: set[str] = set()
    for hashes in hash_lists:
        for h in hashes:
            if h not in seen:
                seen.add(h)
                order.append(h)
    return order
