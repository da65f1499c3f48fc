"""Tiered prefix cache used by prefill workers.

Prefix KV lives in blocks of `block_size` tokens keyed by chained hashes (block_hash.py)
and indexed by a trie (prefix_index.py). Every block is in exactly one tier:

- device: full-precision tensors on the torch device in use;
- host:   CPU memory (pinned when CUDA is present), optionally 4-bit quantized;
- disk:   memory-mapped files in `disk_dir`, optionally 4-bit quantized; found again
          after a restart.

Swapping down goes one tier at a time (device -> host -> disk -> dropped), skipping a
tier where no room can be made (everything there locked); swapping up goes straight to
device. A new block goes to device, or, where the device holds only locked blocks and
blocks protected for a waiting request (`protect`), to the tier below, as if swapped down
at once. A block's `tier` is the fastest tier holding it; the disk keeps
its copy when a block is promoted (so what was on disk survives a restart, and swapping
that block down again writes nothing) until disk space is needed. Rules that must hold:
- a block with lock_count > 0 (held by a PrefixHandle) or a transfer in flight is never
  moved down or dropped;
- only a leaf of the trie (no cached child) leaves the cache, so every cached block's
  parent is cached and every cached block is reachable;
- one transfer per block: concurrent acquirers of a block being promoted wait for the
  first one's transfer (single flight).

Thread safety: every structure is guarded by one re-entrant lock; the disk read of a
promotion runs outside it (the block is locked and marked in flight meanwhile), so
asyncio services may call `acquire` through `asyncio.to_thread`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lamina.kvstore.block_hash import ROOT_HASH, chain_hash
from lamina.kvstore.eviction import EVICTION_POLICIES, BlockStats, make_policy
from lamina.kvstore.prefix_index import PrefixIndex, PrefixMatch
from lamina.kvstore.quant import QuantizedTensor, dequantize_4bit, quantize_4bit
from lamina.kvstore.tiers import DiskTier, MemoryTier, Payload, Tier, payload_nbytes


@dataclass(frozen=True)
class PrefixCacheConfig:
    block_size: int
    device_bytes: int
    host_bytes: int = 0
    disk_bytes: int = 0
    disk_dir: str | None = None
    device: str = "cpu"
    eviction: str = "lru"
    quantize_4bit: bool = False  # for the host and disk tiers
    quant_group_size: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        for name in ("device_bytes", "host_bytes", "disk_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.disk_bytes > 0 and not self.disk_dir:
            raise ValueError("disk_bytes > 0 needs disk_dir")
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(f"unknown eviction policy {self.eviction!r}")
        if self.quant_group_size <= 0 or self.quant_group_size % 2:
            raise ValueError("quant_group_size must be a positive even number")


@dataclass
class CacheStats:
    num_lookups: int = 0
    num_hit_tokens: int = 0
    num_lookup_tokens: int = 0
    # tokens served, by the tier each block was in when the request asked for it
    hit_tokens_by_tier: dict[str, int] = field(
        default_factory=lambda: {"device": 0, "host": 0, "disk": 0})
    num_promotions: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    num_demotions: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    num_dropped: int = 0
    num_inserted: int = 0


@dataclass
class _Entry:
    block_hash: str
    tier: Tier
    num_bytes: int
    inserted_at: int
    last_access: int
    lock_count: int = 0
    loading: Future | None = None
    is_on_disk: bool = False  # a disk copy exists (also when `tier` is faster)
    last_used_at: float = 0.0  # wall clock of its latest insert or hit (published; last_access orders)


@dataclass(frozen=True)
class BlockInfo:
    """One cached block as the metadata store records it."""

    block_hash: str
    parent_hash: str  # ROOT_HASH for a prompt's first block
    num_tokens: int
    tier: Tier  # the fastest tier holding it
    num_bytes: int  # its payload in that tier
    last_used_at: float  # time.time() of its latest insert or hit (or of the start that found it on disk)


# ("stored" | "moved" | "used" | "dropped", block_hash, tier); "used": a hit on it
BlockEvent = tuple[str, str, Tier]


class PrefixHandle:
    """Locked cached prefix of one request; `kv` is on the cache's device.

    Release it (or use it as a context manager) once the prefill has consumed the KV.
    """

    def __init__(self, cache: PrefixCache, block_hashes: tuple[str, ...], num_tokens: int,
                 kv: torch.Tensor | None) -> None:
        self._cache = cache
        self.block_hashes = block_hashes
        self.num_tokens = num_tokens
        self.kv = kv  # [num_layers, 2, num_tokens, n_kv_heads, head_dim] or None on a miss
        self.is_released = False

    def release(self) -> None:
        if not self.is_released:
            self.is_released = True
            self._cache._unlock(self.block_hashes)

    def __enter__(self) -> PrefixHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class PrefixCache:
    def __init__(self, config: PrefixCacheConfig,
                 on_event: Callable[[BlockEvent], None] | None = None) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self._lock = threading.RLock()
        self._index = PrefixIndex(config.block_size)
        self._entries: dict[str, _Entry] = {}
        self._clock = 0
        self._policy = make_policy(config.eviction, config.seed)
        self._protected: dict[str, int] = {}  # block hash -> protect calls not yet ended by unprotect
        self._on_event = on_event
        self.stats = CacheStats()
        self._tiers: dict[Tier, MemoryTier | DiskTier] = {
            Tier.DEVICE: MemoryTier(Tier.DEVICE, self.device, config.device_bytes)}
        if config.host_bytes > 0:
            self._tiers[Tier.HOST] = MemoryTier(Tier.HOST, torch.device("cpu"),
                                                config.host_bytes,
                                                pin_memory=torch.cuda.is_available())
        if config.disk_bytes > 0:
            assert config.disk_dir  # PrefixCacheConfig requires it with disk_bytes
            self._tiers[Tier.DISK] = DiskTier(Path(config.disk_dir), config.disk_bytes)
            self._recover_disk()

    # ---- queries (no locks taken on blocks) ----

    def lookup(self, tokens: Sequence[int]) -> PrefixMatch:
        with self._lock:
            return self._index.match(tokens)

    def tier_distance(self, tokens: Sequence[int]) -> int:
        """0 device, 1 host, 2 disk (the slowest tier of the cached prefix), 3 miss."""
        with self._lock:
            match = self._index.match(tokens)
            if not match.is_hit:
                return int(Tier.NOT_CACHED)
            return int(max(self._entries[h].tier for h in match.block_hashes))

    def tier_of(self, block_hash: str) -> Tier:
        with self._lock:
            entry = self._entries.get(block_hash)
            return entry.tier if entry else Tier.NOT_CACHED

    def used_bytes(self, tier: Tier) -> int:
        t = self._tiers.get(tier)
        return t.used_bytes if t else 0

    def num_blocks(self, tier: Tier | None = None) -> int:
        with self._lock:
            return sum(1 for e in self._entries.values() if tier is None or e.tier == tier)

    def block_info(self, block_hash: str) -> BlockInfo | None:
        """The block as it is now; None when it is not cached."""
        with self._lock:
            e = self._entries.get(block_hash)
            return None if e is None else self._info(e)

    def block_infos(self) -> list[BlockInfo]:
        with self._lock:
            return [self._info(e) for e in self._entries.values()]

    def _info(self, e: _Entry) -> BlockInfo:
        return BlockInfo(e.block_hash, self._index.parent_of(e.block_hash), self.config.block_size, e.tier,
                         e.num_bytes, e.last_used_at)

    def block_records(self) -> list[tuple[str, Tier, int, int]]:
        """(block_hash, tier, bytes, last_access) of every block, to publish metadata."""
        with self._lock:
            return [(e.block_hash, e.tier, e.num_bytes, e.last_access)
                    for e in self._entries.values()]

    # ---- prefill path ----

    def acquire(self, tokens: Sequence[int]) -> PrefixHandle:
        """Locks the longest cached prefix of `tokens`, brings it to device, and returns
        it. If device room cannot be made (everything there is locked), the prefix is cut
        at the first block that does not fit."""
        with self._lock:
            match = self._index.match(tokens)
            self.stats.num_lookups += 1
            self.stats.num_lookup_tokens += len(tokens)
            if not match.is_hit:
                return PrefixHandle(self, (), 0, None)
            now = self._tick()
            wall = time.time()
            source_tiers = []
            for h in match.block_hashes:
                e = self._entries[h]
                e.lock_count += 1
                e.last_access = now
                e.last_used_at = wall
                source_tiers.append(e.tier)
                self._emit("used", h, e.tier)
        kept = len(match.block_hashes)
        for i, h in enumerate(match.block_hashes):
            if not self._promote(h):
                kept = i
                break
        hashes = match.block_hashes[:kept]
        self._unlock(match.block_hashes[kept:])
        bs = self.config.block_size
        num_tokens = match.num_tokens if kept == len(match.block_hashes) else kept * bs
        with self._lock:
            for i, tier in enumerate(source_tiers[:kept]):
                n = min(bs, num_tokens - i * bs)
                self.stats.hit_tokens_by_tier[tier.name.lower()] += n
            self.stats.num_hit_tokens += num_tokens
            blocks = [self._device_block(h) for h in hashes]
        if not blocks:
            return PrefixHandle(self, (), 0, None)
        kv = torch.cat(blocks, dim=2)[:, :, :num_tokens]  # [L, 2, num_tokens, H, D]
        return PrefixHandle(self, hashes, num_tokens, kv)

    def read(self, tokens: Sequence[int]) -> tuple[int, torch.Tensor | None]:
        """(n, kv): the longest cached prefix of `tokens` and its KV ([L, 2, n, H, D], full
        precision), read from whichever tier holds each block, moving nothing: a peer
        worker's fetch, which must not push this worker's own hot blocks down. The
        blocks are locked while they are read; it counts as no hit here."""
        with self._lock:
            match = self._index.match(tokens)
            if not match.is_hit:
                return 0, None
            for h in match.block_hashes:
                self._entries[h].lock_count += 1
        try:
            blocks = [self._read_block(h) for h in match.block_hashes]
        finally:
            self._unlock(match.block_hashes)
        kv = torch.cat(blocks, dim=2)[:, :, :match.num_tokens]  # [L, 2, n, H, D]
        return match.num_tokens, kv

    def _read_block(self, block_hash: str) -> torch.Tensor:
        """A locked block's KV, from its tier (a promotion in flight finishes first)."""
        with self._lock:
            entry = self._entries[block_hash]
            loading = entry.loading
        if loading is not None:
            loading.result()
        with self._lock:
            tier = entry.tier
        return self._to_full(self._payload(block_hash, tier))

    def _payload(self, block_hash: str, tier: Tier) -> Payload:
        """A locked block's payload as `tier` holds it; a disk read happens outside the
        lock (the block is locked, so it stays)."""
        if tier == Tier.DISK:
            return self._disk().read(block_hash)
        with self._lock:
            return self._memory(tier).get(block_hash)

    def insert(self, tokens: Sequence[int], kv: torch.Tensor) -> int:
        """Caches the full blocks of a prompt's KV; kv: [L, 2, T, H, D] with T >= the
        tokens covered. Returns the number of blocks newly stored."""
        bs = self.config.block_size
        num_blocks = min(len(tokens), kv.shape[2]) // bs
        stored = 0
        parent = ROOT_HASH
        with self._lock:
            for i in range(num_blocks):
                block_tokens = tuple(tokens[i * bs:(i + 1) * bs])
                h = chain_hash(parent, block_tokens)
                now = self._tick()
                entry = self._entries.get(h)
                if entry is not None:
                    entry.last_access = now
                    entry.last_used_at = time.time()
                    self._emit("used", h, entry.tier)
                    parent = h
                    continue
                block = kv[:, :, i * bs:(i + 1) * bs].detach().clone()  # [L, 2, bs, H, D]
                # Making room may move the parent down a tier (fine) or, as a leaf, drop
                # it; then this block would be unreachable, and so would the rest.
                room = self._room_for_new(block)
                if room is None:
                    break
                if parent != ROOT_HASH and parent not in self._entries:
                    break
                tier, payload = room
                self._index.insert(parent, block_tokens)
                if tier == Tier.DISK:
                    self._disk().put(h, payload, parent, block_tokens)
                    nbytes = self._disk().file_size(h)
                else:
                    self._memory(tier).put(h, payload)
                    nbytes = payload_nbytes(payload)
                self._entries[h] = _Entry(h, tier, nbytes, now, now, is_on_disk=tier == Tier.DISK,
                                          last_used_at=time.time())
                self.stats.num_inserted += 1
                self._emit("stored", h, tier)
                stored += 1
                parent = h
        return stored

    def _room_for_new(self, block: torch.Tensor) -> tuple[Tier, Payload] | None:
        """Where a new block goes, room made there, and its payload for that tier: device;
        or, when the device holds only blocks locked or protected for a waiting request
        (which stay: that request needs them, this block may never be asked for again),
        the fastest lower tier with room, as a demotion would store it."""
        nbytes = payload_nbytes(block)
        if self._make_room(Tier.DEVICE, nbytes, may_evict_protected=False):
            return Tier.DEVICE, block
        if nbytes > self._tiers[Tier.DEVICE].capacity_bytes:
            return None  # no acquire could bring it up
        payload: Payload = block
        if self.config.quantize_4bit:
            payload = quantize_4bit(block, self.config.quant_group_size)
        lower = self._lower(Tier.DEVICE)
        while lower is not None:
            if self._make_room(lower, payload_nbytes(payload)):
                return lower, payload
            lower = self._lower(lower)
        return None

    # ---- prefetch support ----

    def protect(self, block_hashes: Iterable[str]) -> None:
        """Blocks an upcoming request needs: eviction picks them only when nothing else
        can go, and never moves them off the device tier to make room for an `insert` or
        a `promote` (an `acquire` may: the request being prefilled now comes first).
        Counted: a block stays protected until `unprotect` has named it as often as
        `protect` did (two waiting requests may need it)."""
        with self._lock:
            for h in block_hashes:
                self._protected[h] = self._protected.get(h, 0) + 1

    def unprotect(self, block_hashes: Iterable[str]) -> None:
        """Ends one `protect` of each block (its request has taken its prefix)."""
        with self._lock:
            for h in block_hashes:
                count = self._protected.get(h, 0) - 1
                if count > 0:
                    self._protected[h] = count
                else:
                    self._protected.pop(h, None)

    def is_protected(self, block_hash: str) -> bool:
        with self._lock:
            return block_hash in self._protected

    def promote(self, block_hash: str) -> bool:
        """Moves a cached block to device ahead of use (a prefetch); False if absent or
        no room could be made without evicting protected blocks."""
        with self._lock:
            entry = self._entries.get(block_hash)
            if entry is None:
                return False
            if entry.tier == Tier.DEVICE and entry.loading is None:
                return True
            entry.lock_count += 1
        try:
            return self._promote(block_hash, may_evict_protected=False)
        finally:
            self._unlock((block_hash,))

    # ---- internals ----

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _emit(self, kind: str, block_hash: str, tier: Tier) -> None:
        if self._on_event is not None:
            self._on_event((kind, block_hash, tier))

    def _unlock(self, block_hashes: Iterable[str]) -> None:
        with self._lock:
            for h in block_hashes:
                self._entries[h].lock_count -= 1

    def _promote(self, block_hash: str, may_evict_protected: bool = True) -> bool:
        """Brings a locked block to device; single flight per block."""
        with self._lock:
            entry = self._entries[block_hash]
            if entry.loading is not None:
                waiting_on = entry.loading
            elif entry.tier == Tier.DEVICE:
                return True
            else:
                waiting_on = None
                entry.loading = Future()
                source = entry.tier
        if waiting_on is not None:
            is_done = waiting_on.result()
            with self._lock:
                # The first transfer may have failed for lack of room; retry once here.
                if is_done or entry.tier == Tier.DEVICE:
                    return entry.tier == Tier.DEVICE
            return self._promote(block_hash, may_evict_protected)
        is_done = False
        try:
            block = self._to_full(self._payload(block_hash, source))
            with self._lock:
                nbytes = payload_nbytes(block)
                if self._make_room(Tier.DEVICE, nbytes, may_evict_protected):
                    if source != Tier.DISK:  # the disk copy stays (see module doc)
                        self._remove_from(source, block_hash)
                    self._memory(Tier.DEVICE).put(block_hash, block)
                    entry.tier, entry.num_bytes = Tier.DEVICE, nbytes
                    self.stats.num_promotions[source.name.lower()] += 1
                    self._emit("moved", block_hash, Tier.DEVICE)
                    is_done = True
        finally:
            with self._lock:
                fut, entry.loading = entry.loading, None
            fut.set_result(is_done)
        return is_done

    def _to_full(self, payload: Payload) -> torch.Tensor:
        if isinstance(payload, QuantizedTensor):
            return dequantize_4bit(payload.to(self.device))
        return payload.to(self.device)

    def _memory(self, tier: Tier) -> MemoryTier:
        """The device or host store (the disk's is `_disk`)."""
        store = self._tiers[tier]
        assert isinstance(store, MemoryTier), f"{tier.name} is not a memory tier"
        return store

    def _disk(self) -> DiskTier:
        store = self._tiers[Tier.DISK]
        assert isinstance(store, DiskTier)
        return store

    def _device_block(self, block_hash: str) -> torch.Tensor:
        block = self._memory(Tier.DEVICE).get(block_hash)
        assert isinstance(block, torch.Tensor)  # blocks are quantized only below the device tier
        return block

    def _remove_from(self, tier: Tier, block_hash: str) -> None:
        store = self._tiers[tier]
        if isinstance(store, DiskTier):
            store.remove(block_hash)
        else:
            store.pop(block_hash)

    def _lower(self, tier: Tier) -> Tier | None:
        for t in range(tier + 1, Tier.NOT_CACHED):
            if Tier(t) in self._tiers:
                return Tier(t)
        return None

    def _make_room(self, tier: Tier, nbytes: int, may_evict_protected: bool = True) -> bool:
        store = self._tiers[tier]
        if nbytes > store.capacity_bytes:
            return False
        lower = self._lower(tier)
        while not store.has_room(nbytes):
            victim = self._choose_victim(tier, is_drop=lower is None,
                                         may_evict_protected=may_evict_protected)
            if victim is None:
                return False
            if tier == Tier.DISK and self._entries[victim].tier != Tier.DISK:
                self._disk().remove(victim)  # only a copy: the block stays
                self._entries[victim].is_on_disk = False
                continue
            if lower is None or not self._demote_below(victim, tier, lower):
                if not self._index.is_leaf(victim):
                    return False
                self._drop(victim)
        return True

    def _choose_victim(self, tier: Tier, is_drop: bool, may_evict_protected: bool) -> str | None:
        if tier == Tier.DISK:
            # Disk copies of faster blocks may go even when those are locked.
            candidates = [e for e in self._entries.values()
                          if e.is_on_disk and e.loading is None
                          and (e.tier != Tier.DISK
                               or (e.lock_count == 0 and self._index.is_leaf(e.block_hash)))]
        else:
            candidates = [e for e in self._entries.values()
                          if e.tier == tier and e.lock_count == 0 and e.loading is None
                          and (not is_drop or self._index.is_leaf(e.block_hash))]
        unprotected = [e for e in candidates if e.block_hash not in self._protected]
        if unprotected:
            candidates = unprotected
        elif not may_evict_protected:
            return None
        if not candidates:
            return None
        return self._policy([BlockStats(e.block_hash, e.inserted_at, e.last_access,
                                        e.num_bytes) for e in candidates])

    def _demote_below(self, block_hash: str, tier: Tier, lower: Tier) -> bool:
        """Moves one block down to `lower` or, when no room can be made there (every
        block there locked, e.g. by the acquire that is making this room), to a tier
        further down."""
        below: Tier | None = lower
        while below is not None:
            if self._demote(block_hash, tier, below):
                return True
            below = self._lower(below)
        return False

    def _demote(self, block_hash: str, tier: Tier, lower: Tier) -> bool:
        """Moves one block one tier down (after making room there)."""
        entry = self._entries[block_hash]
        if tier == Tier.DISK:
            return False
        if lower == Tier.DISK and entry.is_on_disk:
            self._memory(tier).pop(block_hash)
            entry.tier, entry.num_bytes = Tier.DISK, self._disk().file_size(block_hash)
            self.stats.num_demotions["disk"] += 1
            self._emit("moved", block_hash, Tier.DISK)
            return True
        payload = self._memory(tier).get(block_hash)
        if self.config.quantize_4bit and not isinstance(payload, QuantizedTensor):
            payload = quantize_4bit(payload, self.config.quant_group_size)
        nbytes = payload_nbytes(payload)
        # Guard the victim while the lower tier evicts (it must not pick it again).
        entry.lock_count += 1
        try:
            is_room = self._make_room(lower, nbytes)
        finally:
            entry.lock_count -= 1
        if not is_room:
            return False
        self._memory(tier).pop(block_hash)
        if lower == Tier.DISK:
            disk = self._disk()
            disk.put(block_hash, payload, self._index.parent_of(block_hash),
                     self._index.tokens_of(block_hash))
            nbytes = disk.file_size(block_hash)
            entry.is_on_disk = True
        else:
            self._memory(lower).put(block_hash, payload)
        entry.tier, entry.num_bytes = lower, nbytes
        self.stats.num_demotions[lower.name.lower()] += 1
        self._emit("moved", block_hash, lower)
        return True

    def _drop(self, block_hash: str) -> None:
        entry = self._entries.pop(block_hash)
        self._remove_from(entry.tier, block_hash)
        if entry.is_on_disk and entry.tier != Tier.DISK:
            self._disk().remove(block_hash)
        self._index.remove(block_hash)
        self.stats.num_dropped += 1
        self._emit("dropped", block_hash, entry.tier)

    def _recover_disk(self) -> None:
        """Re-indexes blocks left on disk by an earlier process; orphans are deleted."""
        disk = self._disk()
        records = {r.block_hash: r for r in disk.scan()}
        pending = dict(records)
        is_progress = True
        while pending and is_progress:
            is_progress = False
            for h, r in list(pending.items()):
                if r.parent_hash == ROOT_HASH or r.parent_hash in self._entries:
                    if (len(r.tokens) != self.config.block_size
                            or chain_hash(r.parent_hash, r.tokens) != h):
                        continue  # another block size or a corrupt header: deleted below
                    self._index.insert(r.parent_hash, r.tokens)
                    now = self._tick()
                    self._entries[h] = _Entry(h, Tier.DISK, r.num_bytes, now, now,
                                              is_on_disk=True, last_used_at=time.time())
                    del pending[h]
                    is_progress = True
        for h in pending:
            disk.remove(h)
