"""Token-granular slab allocator for attention workers' KV.

Memory is `capacity_bytes` of per-layer pools: for each layer a K and a V tensor of
[num_slots, n_kv_heads, head_dim] of `dtype`. A slot holds one token's K and V in every
layer, so one slot index addresses a token in all pools. The allocator never looks
inside a row: a packed format gives its bytes per head as head_dim, with dtype uint8
(the attention workers' 4-bit KV, lamina.services.attention.attention_core). Slots are grouped into slabs of
`tokens_per_slab`; a slab is opened (its slots join the free list) only when the free
list is empty, so a lightly loaded worker touches few pages.

Free list: a LIFO stack. Opening a slab pushes its slots highest first, so slots pop in
increasing order; freeing a request pushes its slots last-position first, so the next
allocation reuses them in the same order (recently freed memory is warm, and a reused
range stays contiguous).

Sharing: `fork` gives a new request the first n tokens of another by reference (the
reference count of each slot counts the requests using it). Writing a position whose
slot is shared first copies it to a fresh slot (copy-on-write) in every layer. Sharing is
per token, so a fork shares every slot of the prefix, those of a partly filled last slab
included, and copies nothing until a shared position is written: the choices of an n > 1
request share their prompt this way, each appending its own tokens to fresh slots.

Slot lists: each request's slots are kept as an int64 array, so the slots of a batch of
requests concatenate into one index tensor without a Python loop over tokens
(`batch_slots`); `slot_version` changes whenever a request's slots do (extension,
copy-on-write) and never repeats, even for an id freed and allocated again, so a caller
can keep such a tensor across the layers of a step and know when it is stale.

Failure: `allocate`, `extend` and `prepare_write` raise KVAllocationError before any
state changes when the free list cannot cover the request; `can_allocate` answers the
same question without raising, so a scheduler can check before admitting a request.
Not thread-safe: one attention worker's event loop owns it.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import count

import torch

from lamina.model.uploads import upload


class KVAllocationError(RuntimeError):
    """Not enough free KV slots; nothing was changed. The scheduler can wait, preempt or
    route the request elsewhere."""

    def __init__(self, num_requested: int, num_available: int) -> None:
        super().__init__(f"KV allocation of {num_requested} tokens failed: "
                         f"{num_available} free")
        self.num_requested = num_requested
        self.num_available = num_available


@dataclass(frozen=True)
class SlabConfig:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    capacity_bytes: int
    tokens_per_slab: int = 256
    dtype: torch.dtype = torch.float32
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "tokens_per_slab"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.num_slabs < 1:
            raise ValueError(f"capacity_bytes={self.capacity_bytes} holds no slab of "
                             f"{self.tokens_per_slab} tokens "
                             f"({self.bytes_per_token} bytes per token)")

    # Computed once (the fields never change): a decode frame reads them several times.
    @cached_property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @cached_property
    def num_slabs(self) -> int:
        return self.capacity_bytes // (self.bytes_per_token * self.tokens_per_slab)

    @cached_property
    def num_slots(self) -> int:
        return self.num_slabs * self.tokens_per_slab


class SlabAllocator:
    def __init__(self, config: SlabConfig) -> None:
        self.config = config
        n, h, d = config.num_slots, config.num_kv_heads, config.head_dim
        # torch.empty: pages are committed when first written, i.e. slab by slab.
        self.k_pools = [torch.empty(n, h, d, dtype=config.dtype, device=config.device)
                        for _ in range(config.num_layers)]  # each [num_slots, H, D]
        self.v_pools = [torch.empty(n, h, d, dtype=config.dtype, device=config.device)
                        for _ in range(config.num_layers)]
        self._free: list[int] = []  # LIFO: the top is the end of the list
        self._refcount = [0] * n
        self._seqs: dict[str, array] = {}  # request id -> slot of each position (int64)
        self._versions: dict[str, int] = {}  # request id -> stamp of its slots' last change
        self._stamps = count(1)
        self.num_open_slabs = 0

    # ---- accounting ----

    @property
    def num_total_tokens(self) -> int:
        return self.config.num_slots

    @property
    def num_free_tokens(self) -> int:
        unopened = self.config.num_slabs - self.num_open_slabs
        return len(self._free) + unopened * self.config.tokens_per_slab

    @property
    def num_used_tokens(self) -> int:
        return self.num_total_tokens - self.num_free_tokens

    @property
    def num_requests(self) -> int:
        return len(self._seqs)

    @property
    def num_sequence_tokens(self) -> int:
        """Every request's tokens, a shared slot counted once per request using it: with
        forks, more than `num_used_tokens` (each slot counted once)."""
        return sum(map(len, self._seqs.values()))

    @property
    def occupancy(self) -> float:
        """Used slots / all slots."""
        return self.num_used_tokens / self.num_total_tokens

    @property
    def fragmentation(self) -> float:
        """Free slots inside opened slabs / slots of opened slabs: memory held by slabs
        but not by tokens."""
        opened = self.num_open_slabs * self.config.tokens_per_slab
        return len(self._free) / opened if opened else 0.0

    def refcount(self, slot: int) -> int:
        return self._refcount[slot]

    def has_request(self, request_id: str) -> bool:
        return request_id in self._seqs

    def num_tokens(self, request_id: str) -> int:
        return len(self._seqs[request_id])

    def slots(self, request_id: str) -> list[int]:
        return list(self._seqs[request_id])

    def slot_tensor(self, request_id: str) -> torch.Tensor:
        return _int64_tensor([self._seqs[request_id]]).to(self.config.device)  # [T]

    def batch_slots(self, request_ids: Sequence[str]) -> torch.Tensor:
        """The slots of each request in position order, concatenated: int64 [sum T] (CPU)."""
        return _int64_tensor([self._seqs[r] for r in request_ids])

    def slot_version(self, request_id: str) -> int:
        """Changes whenever the request's slots change; never repeats, even for a
        request id that is freed and allocated again."""
        return self._versions[request_id]

    def slab_ranges(self, request_id: str) -> list[tuple[int, int]]:
        """The request's slots as contiguous [start, end) runs, in position order."""
        ranges: list[tuple[int, int]] = []
        for s in self._seqs[request_id]:
            if ranges and ranges[-1][1] == s:
                ranges[-1] = (ranges[-1][0], s + 1)
            else:
                ranges.append((s, s + 1))
        return ranges

    # ---- allocation ----

    def can_allocate(self, num_tokens: int) -> bool:
        return num_tokens <= self.num_free_tokens

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """A new request with `num_tokens` fresh slots; returns them."""
        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} already holds KV")
        slots = self._pop(num_tokens)
        self._seqs[request_id] = array("q", slots)
        self._versions[request_id] = next(self._stamps)
        return slots

    def fork(self, source_id: str, request_id: str, num_tokens: int) -> list[int]:
        """A new request sharing the first `num_tokens` tokens of `source_id`."""
        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} already holds KV")
        source = self._seqs[source_id]
        if not 0 <= num_tokens <= len(source):
            raise ValueError(f"cannot share {num_tokens} of {len(source)} tokens")
        shared = source[:num_tokens]
        for s in shared:
            self._refcount[s] += 1
        self._seqs[request_id] = shared
        self._versions[request_id] = next(self._stamps)
        return list(shared)

    def extend(self, request_id: str, num_tokens: int = 1) -> list[int]:
        """Appends fresh slots (decode steps); returns them."""
        seq = self._seqs[request_id]
        slots = self._pop(num_tokens)
        seq.extend(slots)
        self._versions[request_id] = next(self._stamps)
        return slots

    def free(self, request_id: str) -> int:
        """Ends a request; returns how many slots went back to the free list."""
        seq = self._seqs.pop(request_id)
        del self._versions[request_id]
        num_freed = 0
        for s in reversed(seq):  # so the first position's slot ends on top
            self._refcount[s] -= 1
            if self._refcount[s] == 0:
                self._free.append(s)
                num_freed += 1
        return num_freed

    def abort(self, request_id: str) -> int:
        """Same as free, for a request that did not finish; unknown ids are ignored so
        that an abort racing a normal end is harmless."""
        return self.free(request_id) if request_id in self._seqs else 0

    # ---- KV data ----

    def prepare_write(self, request_id: str, start: int, num_tokens: int) -> None:
        """Makes positions [start, start + num_tokens) exclusive to the request,
        copying shared slots (all layers) to fresh ones."""
        seq = self._seqs[request_id]
        if start < 0 or start + num_tokens > len(seq):
            raise IndexError(f"positions {start}..{start + num_tokens} outside "
                             f"{len(seq)} tokens")
        shared = [p for p in range(start, start + num_tokens) if self._refcount[seq[p]] > 1]
        if not shared:
            return
        fresh = self._pop(len(shared))
        old = torch.tensor([seq[p] for p in shared], dtype=torch.long, device=self.config.device)
        new = torch.tensor(fresh, dtype=torch.long, device=self.config.device)
        for k, v in zip(self.k_pools, self.v_pools):
            k[new] = k[old]
            v[new] = v[old]
        for p, s in zip(shared, fresh):
            self._refcount[seq[p]] -= 1
            seq[p] = s
        self._versions[request_id] = next(self._stamps)

    def write(self, request_id: str, layer: int, start: int, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """k, v: [n, H, D] for positions [start, start + n) of layer `layer`."""
        n = k.shape[0]
        self.prepare_write(request_id, start, n)
        idx = upload(_int64_tensor([self._seqs[request_id][start:start + n]]), self.config.device)
        self.k_pools[layer][idx] = k
        self.v_pools[layer][idx] = v

    def read(self, request_id: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every position of the request in one layer: each [T, H, D]."""
        idx = self.slot_tensor(request_id)
        return self.k_pools[layer][idx], self.v_pools[layer][idx]

    # ---- internals ----

    def _pop(self, num_tokens: int) -> list[int]:
        if num_tokens < 0:
            raise ValueError("num_tokens must be >= 0")
        if not self.can_allocate(num_tokens):
            raise KVAllocationError(num_tokens, self.num_free_tokens)
        out = []
        for _ in range(num_tokens):
            if not self._free:
                self._open_slab()
            s = self._free.pop()
            self._refcount[s] = 1
            out.append(s)
        return out

    def _open_slab(self) -> None:
        size = self.config.tokens_per_slab
        first = self.num_open_slabs * size
        self._free.extend(range(first + size - 1, first - 1, -1))
        self.num_open_slabs += 1


def _int64_tensor(parts: list[array]) -> torch.Tensor:
    """int64 arrays concatenated into one tensor: a byte copy, no per-element Python."""
    data = bytearray().join(parts)
    return torch.frombuffer(data, dtype=torch.int64) if data else torch.empty(0, dtype=torch.int64)
