"""Publishes a prefill worker's prefix-cache blocks to the metadata store.

The cache reports every change (`PrefixCache(on_event=publisher.on_event)`): a block
stored, moved between tiers, used by a hit, or dropped. `on_event` only notes the
block's hash (it runs under the cache's lock, on whatever thread called the cache);
an owned task writes the noted blocks as they are *then* (`PrefixCache.block_info`:
tier, bytes, parent, last use; gone means removed) in one transaction per batch,
`interval_s` after the first change of the batch. So the request path never waits on
Redis, and a block changed several times in a batch is written once.

`republish()` asks for the whole cache to replace the node's set in the store (at
start, including what the disk tier brought back, and after a Redis that lost its
data). A failed write (Redis down) keeps what it was writing and is retried every
`retry_s`, so the store converges on the cache once Redis answers.

Ownership: `start()` starts the task, `close()` cancels and awaits it and, with
`withdraw=True`, removes the node's blocks (a worker that stops takes its entries along).
"""

from __future__ import annotations

import asyncio
import logging
import threading

from lamina.kvstore.batches import write_batches
from lamina.kvstore.metadata import REDIS_ERRORS, BlockRecord, MetadataStore
from lamina.kvstore.prefix_cache import BlockEvent, BlockInfo, PrefixCache

log = logging.getLogger(__name__)


def block_record(info: BlockInfo) -> BlockRecord:
    return BlockRecord(info.block_hash, int(info.tier), info.num_bytes, info.last_used_at, info.parent_hash,
                       info.num_tokens)


class BlockPublisher:
    def __init__(self, store: MetadataStore, node: str, cache: PrefixCache | None = None, interval_s: float = 0.05,
                 retry_s: float = 1.0) -> None:
        self.store = store
        self.node = node
        self.cache = cache
        self.interval_s = interval_s
        self.retry_s = retry_s
        self._lock = threading.Lock()  # guards _dirty and _is_full (on_event may run on any thread)
        self._dirty: set[str] = set()
        self._is_full = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.is_failing = False
        self.num_batches = 0  # transactions written

    def on_event(self, event: BlockEvent) -> None:
        _, block_hash, _ = event
        with self._lock:
            is_first = not self._dirty and not self._is_full
            self._dirty.add(block_hash)
        if is_first and self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def republish(self) -> None:
        """Replace the node's set in the store with the whole cache (soon, in the task)."""
        with self._lock:
            self._is_full = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def rebuild(self, store: MetadataStore) -> None:
        """ServiceRegistration's rebuild hook: Redis lost the node's entries."""
        self.republish()

    def start(self, republish: bool = True) -> None:
        self._loop = asyncio.get_running_loop()
        if republish:
            self._is_full = True
        if self._is_full or self._dirty:
            self._wake.set()
        self._task = asyncio.create_task(write_batches(self._wake, self.flush, self.interval_s, self.retry_s),
                                         name=f"blocks:{self.node}")

    async def close(self, withdraw: bool = False) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._loop = None
        if withdraw:
            try:
                await self.store.clear_node_blocks(self.node)
            except REDIS_ERRORS as exc:
                log.warning("blocks of %s not withdrawn (metadata store unreachable: %s)", self.node, exc)

    async def flush(self) -> bool:
        """Write what changed since the last batch; False (changes kept) if Redis failed."""
        with self._lock:
            dirty, self._dirty = self._dirty, set()
            is_full, self._is_full = self._is_full, False
        if not dirty and not is_full:
            return True
        cache = self.cache
        if cache is None:  # set after construction: the cache takes on_event, made first
            raise RuntimeError(f"the block publisher of {self.node} has no cache to publish")
        try:
            if is_full:
                await self.store.replace_node_blocks(
                    self.node, [block_record(i) for i in cache.block_infos()])
            else:
                infos = {h: cache.block_info(h) for h in dirty}
                await self.store.update_blocks(self.node, [block_record(i) for i in infos.values() if i is not None],
                                               sorted(h for h, i in infos.items() if i is None))
        except REDIS_ERRORS as exc:
            if not self.is_failing:
                log.warning("blocks of %s not published (metadata store unreachable: %s); retrying", self.node, exc)
            self.is_failing = True
            with self._lock:
                self._dirty |= dirty
                self._is_full |= is_full
            return False
        if self.is_failing:
            log.info("blocks of %s published again", self.node)
        self.is_failing = False
        self.num_batches += 1
        return True
