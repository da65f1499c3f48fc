"""Attention of a whole batch over KV read where it is stored: one call per layer.

Two ways KV is stored, one kernel (csrc/kv_attention.c, built into
`model._kv_attention`; `NATIVE` is None where it could not be built, and the
torch reference below runs instead, with the same results):

- `slot_attention`: KV in a slab pool ([S, Hkv, D] per layer, lamina.kvstore.slab), each
  sequence's keys named by their slots (a `SlotBatch`, built once per step and used
  for every layer): the attention workers' layout. The pool's rows may be 4-bit
  packed (`packed`: uint8 [S, Hkv, row_bytes], lamina.model.kv_quant): the kernel decodes
  them a block of keys and one head at a time; the torch path decodes a sequence's
  keys of the layer at once (the same floats, lamina.model.kv_quant) and attends as for
  float rows.
- `BufferBatch`: each sequence's KV in a buffer of its own ([num_layers, 2, capacity,
  Hkv, D]: the local engine's layout), addressed once per step; it also appends the new
  tokens' K and V to every buffer in one call per layer.
- `buffer_attention`: each sequence's keys and values given as tensors
  ([L_b, Hkv, D], contiguous), checked at every call.

Both take the new tokens' queries of every sequence concatenated (q: [T, Hq, D],
`query_lens` per sequence, T = sum(query_lens), Hq a multiple of Hkv) and return
out [T, Hq, D] and, with `need_lse`, the log-sum-exp of the scaled scores lse [T, Hq]
(float32; -inf for a query that saw no key, whose out is 0, so its partial combines as
nothing: see lamina.model.attention.combine_partials). With `causal`, query i of a sequence of
n queries and L keys sees keys 0 .. L - n + i (the queries are the last n keys);
without, every key (Q-early's part over the KV held before the step).

The kernel makes one pass over each sequence's keys with an online softmax; every query
head of a sequence is served from each K and V row while it is in cache, so a row comes
from memory once; it accumulates in float32 like the reference, so the two agree to
float rounding (tests/model/test_kv_attention.py). It runs on the products' threads
(lamina.model.quant.kernel_threads, the native products' worker pool): the sequences,
and when there are few of them runs of their KV heads, are shared out, each row
computed by one thread in the same order whatever the thread count, so the results
do not depend on it. Everything the kernel relies on
(dtypes, shapes, contiguity, the CPU, slots inside the pool, lengths) is checked here
first: a bad argument raises ValueError, never reaches the C code.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from lamina.model import quant
from lamina.model.attention import attention_with_lse
from lamina.model.kv_quant import Q4Rows

try:
    import lamina.model._kv_attention as NATIVE  # noqa: N812 (a module constant: the native kernel, or None)
except ImportError:  # not built (no C compiler at install): the torch reference runs
    NATIVE = None
if NATIVE is not None and quant.NATIVE is not None:
    # One pool of worker threads for every native kernel: the products' (csrc/qmatmul.c).
    NATIVE.use_pool(quant.NATIVE.parallel_pool())


def _offsets(lens: Sequence[int]) -> array:
    """int64 [B + 1] start of each sequence, then the total."""
    return array("q", accumulate(lens, initial=0))


def _addr(a: array) -> int:
    return a.buffer_info()[0]


def _is_cpu_float32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


def _check_q(q: torch.Tensor, query_lens: Sequence[int], hkv: int, d: int) -> None:
    if q.dim() != 3 or not _is_cpu_float32(q):
        raise ValueError(f"q must be a contiguous float32 [T, Hq, D] CPU tensor, got {q.dtype} {tuple(q.shape)} "
                         f"on {q.device}")
    if q.shape[2] != d or q.shape[1] == 0 or q.shape[1] % hkv:
        raise ValueError(f"q {tuple(q.shape)} does not fit KV of {hkv} heads of dimension {d}")
    if any(n < 0 for n in query_lens) or sum(query_lens) != q.shape[0]:
        raise ValueError(f"query_lens {list(query_lens)[:8]} do not add up to the {q.shape[0]} rows of q")


def _outputs(q: torch.Tensor, query_lens: Sequence[int], kv_lens: Sequence[int], causal: bool,
             need_lse: bool, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    if len(query_lens) != len(kv_lens):
        raise ValueError(f"{len(query_lens)} query lengths for {len(kv_lens)} sequences of keys")
    if causal and any(n > length for n, length in zip(query_lens, kv_lens)):
        raise ValueError("a sequence has more queries than keys (causal queries are its last keys)")
    out = _into(out, q)  # [T, Hq, D]
    return out, torch.empty(q.shape[:2], dtype=torch.float32) if need_lse else None  # [T, Hq]


def _into(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """`out` where the kernel may write an attention output of q's shape into it (the
    kernel reads q while it writes: they must not share memory), else a new tensor."""
    if out is None:
        return torch.empty_like(q)
    if not (out.shape == q.shape and out.dtype == torch.float32 and out.is_cpu and out.is_contiguous()):
        raise ValueError(f"out must be a contiguous float32 CPU tensor of q's shape {tuple(q.shape)}, "
                         f"got {out.dtype} {tuple(out.shape)}")
    o, a, n = out.data_ptr(), q.data_ptr(), q.numel() * 4  # both contiguous float32
    if o < a + n and a < o + n:
        raise ValueError("out must not share memory with q")
    return out


@dataclass(frozen=True)
class SlotBatch:
    """The slots of a batch's sequences, checked once and reused for every layer.

    slots: int64 [sum(lens)] (CPU, contiguous), each sequence's slots in position
    order, concatenated; lens: keys per sequence; num_slots: the pool size every slot
    is below. The tensor must not change after the batch is built (the kernel trusts
    the range check done here)."""

    slots: torch.Tensor
    lens: tuple[int, ...]
    num_slots: int
    starts: array = field(init=False, repr=False, compare=False)  # int64 [B + 1] offsets into slots

    def __post_init__(self) -> None:
        s = self.slots
        if s.dtype != torch.int64 or s.dim() != 1 or not s.is_contiguous() or s.device.type != "cpu":
            raise ValueError(f"slots must be a contiguous int64 [N] CPU tensor, got {s.dtype} {tuple(s.shape)}")
        if any(n < 0 for n in self.lens) or sum(self.lens) != s.numel():
            raise ValueError(f"{s.numel()} slots for sequences of {sum(self.lens)} keys")
        if s.numel() and (int(s.min()) < 0 or int(s.max()) >= self.num_slots):
            raise ValueError(f"slots outside the pool of {self.num_slots}")
        object.__setattr__(self, "starts", _offsets(self.lens))

    @classmethod
    def build(cls, per_sequence: Sequence[Sequence[int]], num_slots: int) -> SlotBatch:
        slots = torch.tensor([x for seq in per_sequence for x in seq], dtype=torch.int64)
        return cls(slots, tuple(len(s) for s in per_sequence), num_slots)


def _check_pools(k_pool: torch.Tensor, v_pool: torch.Tensor, packed: Q4Rows | None) -> tuple[int, int, int]:
    """(num_slots, Hkv, D) of pools of float32 rows [S, Hkv, D] or packed rows [S, Hkv, row_bytes]."""
    dtype, width = (torch.float32, None) if packed is None else (torch.uint8, packed.row_bytes)
    name = str(dtype).removeprefix("torch.")
    if k_pool.dim() != 3 or k_pool.shape != v_pool.shape or any(
            t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous() for t in (k_pool, v_pool)) \
            or width not in (None, k_pool.shape[2]):
        raise ValueError(f"k_pool {k_pool.dtype} {tuple(k_pool.shape)} and v_pool {v_pool.dtype} "
                         f"{tuple(v_pool.shape)} must be contiguous {name} [S, Hkv, {width or 'D'}] CPU tensors")
    num_slots, hkv, d = k_pool.shape
    return num_slots, hkv, d if packed is None else packed.head_dim


def slot_attention(q: torch.Tensor, query_lens: Sequence[int], k_pool: torch.Tensor, v_pool: torch.Tensor,
                   batch: SlotBatch, kv_lens: Sequence[int] | None = None, *, causal: bool = True,
                   need_lse: bool = True, packed: Q4Rows | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """k_pool, v_pool: [S, Hkv, D] contiguous float32, or with `packed`, uint8
    [S, Hkv, packed.row_bytes] of rows of D = packed.head_dim; `batch` names each
    sequence's slots. With `kv_lens`, sequence b attends over its first kv_lens[b] slots only."""
    num_slots, hkv, d = _check_pools(k_pool, v_pool, packed)
    _check_q(q, query_lens, hkv, d)
    if batch.num_slots > num_slots:
        raise ValueError(f"a slot batch for a pool of {batch.num_slots} does not fit a pool of {num_slots}")
    lens = batch.lens if kv_lens is None else tuple(kv_lens)
    if len(lens) != len(batch.lens) or any(not 0 <= n <= m for n, m in zip(lens, batch.lens)):
        raise ValueError("kv_lens must not exceed the sequences' slots")
    out, lse = _outputs(q, query_lens, lens, causal, need_lse)
    if NATIVE is None:
        starts = batch.starts
        keys = [k_pool[batch.slots[s : s + n]] for s, n in zip(starts, lens)]
        values = [v_pool[batch.slots[s : s + n]] for s, n in zip(starts, lens)]
        if packed is not None:
            keys, values = [packed.dequantize(k) for k in keys], [packed.dequantize(v) for v in values]
        return _reference(q, query_lens, keys, values, causal, need_lse)
    b = len(lens)
    q_start = _offsets(query_lens)
    kv_len = array("q", lens)
    k_base, v_base = array("q", [k_pool.data_ptr()]) * b, array("q", [v_pool.data_ptr()]) * b
    NATIVE.attend(q.data_ptr(), out.data_ptr(), lse.data_ptr() if lse is not None else 0, _addr(k_base),
                  _addr(v_base), batch.slots.data_ptr(), _addr(q_start), _addr(batch.starts), _addr(kv_len), b,
                  q.shape[1], hkv, d, causal, d**-0.5, 0 if packed is None else packed.group,
                  quant.kernel_threads())
    return out, lse


class SlotPools:
    """An attention worker's pools for `SlotStep`, checked once: k_pools[l], v_pools[l] are
    layer l's [S, Hkv, D] contiguous float32 CPU pools, all of one shape, never replaced.
    Needs the native kernel.

    The kernel takes a base address per sequence (and `append_rows` one per row): here one
    array per layer repeats the pool's address, long enough for any step so far (grown, as
    new arrays, when a step is larger; a step keeps the arrays it was built with)."""

    def __init__(self, k_pools: Sequence[torch.Tensor], v_pools: Sequence[torch.Tensor]) -> None:
        if NATIVE is None:
            raise ValueError("SlotPools needs the native attention kernel")
        if not k_pools or len(k_pools) != len(v_pools):
            raise ValueError(f"{len(k_pools)} K pools and {len(v_pools)} V pools: one of each per layer")
        shapes = {_check_pools(k, v, None) for k, v in zip(k_pools, v_pools)}
        if len(shapes) != 1:
            raise ValueError(f"pools of several shapes: {sorted(shapes)}")
        (self.num_slots, self.hkv, self.d), = shapes
        self._pools = (list(k_pools), list(v_pools))  # keeps the memory the addresses point to alive
        self.bases: tuple[list[array], list[array]] = ([], [])
        self._repeat = 0

    @property
    def num_layers(self) -> int:
        return len(self._pools[0])

    def repeated(self, n: int) -> tuple[list[array], list[array]]:
        """Per layer, K's and V's pool address at least n times."""
        if n > self._repeat:
            self._repeat = max(n, 2 * self._repeat, 16)
            k_pools, v_pools = self._pools
            self.bases = ([array("q", [t.data_ptr()]) * self._repeat for t in k_pools],
                          [array("q", [t.data_ptr()]) * self._repeat for t in v_pools])
        return self.bases


class SlotStep:
    """One step of an attention worker's decode path, checked and addressed once for all
    its layers: each layer then takes one write of the new rows and one kernel call,
    `slot_attention` (causal, no lse) over `pools`.

    batch: every slot of the step's sequences; query_lens: each sequence's new tokens, the
    last of its slots; new: int64 [T], their slots in row order. The batch must not change
    until the step ends (the attention core builds one per step and checks its sequences'
    slot versions before reusing it)."""

    def __init__(self, pools: SlotPools, batch: SlotBatch, query_lens: Sequence[int], new: torch.Tensor) -> None:
        if batch.num_slots > pools.num_slots:
            raise ValueError(f"a slot batch for a pool of {batch.num_slots} does not fit a pool of {pools.num_slots}")
        self.query_lens = tuple(query_lens)
        if len(self.query_lens) != len(batch.lens) or any(not 0 <= n <= m for n, m in zip(self.query_lens, batch.lens)):
            raise ValueError("query_lens must give each sequence at most as many queries as it has slots")
        rows = sum(self.query_lens)
        if new.dtype != torch.int64 or new.device.type != "cpu" or new.shape != (rows,):
            raise ValueError(f"new must be the int64 [{rows}] CPU slots of the new tokens, got {new.dtype} "
                             f"{tuple(new.shape)} on {new.device}")
        self._at = array("q", new.tolist())  # the new rows' slots
        if rows and (min(self._at) < 0 or max(self._at) >= pools.num_slots):
            raise ValueError(f"new slots outside the pool of {pools.num_slots}")
        self.hkv, self.d, self._layers = pools.hkv, pools.d, pools.num_layers
        self._pools = pools  # keeps the pools' memory alive while the step holds their addresses
        self._batch = batch
        self._rows = rows
        self._q_start = _offsets(self.query_lens)
        self._kv_len = array("q", batch.lens)
        # Base addresses: per sequence for the kernel, per row for the writes (append_rows
        # with every "sequence" a single row of the pool, at its slot).
        self._k_base, self._v_base = pools.repeated(max(len(batch.lens), rows))
        self._one_each = _offsets([1] * rows)

    def _check(self, layer: int, t: torch.Tensor, heads: int | None) -> None:
        if not 0 <= layer < self._layers:
            raise ValueError(f"layer {layer} of {self._layers}")
        want = (self._rows, heads or self.hkv, self.d)
        if t.shape != want or not _is_cpu_float32(t) or (heads is not None and heads % self.hkv):
            raise ValueError(f"expected a contiguous float32 {list(want)} CPU tensor, got {t.dtype} {tuple(t.shape)}")

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, Hkv, D], the new tokens' rows, written to their slots."""
        self._check(layer, k, None)
        self._check(layer, v, None)
        for src, dst in ((k, self._k_base[layer]), (v, self._v_base[layer])):
            NATIVE.append_rows(src.data_ptr(), _addr(dst), _addr(self._at), _addr(self._one_each), self._rows,
                               self.hkv * self.d)

    def attend(self, layer: int, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, Hq, D] -> out [T, Hq, D]: each query over its sequence's keys up to its own,
        written into `out` when given (a contiguous float32 tensor of q's shape, none of it
        q), else into a new tensor."""
        self._check(layer, q, q.shape[1] if q.dim() == 3 and q.shape[1] else None)
        out = _into(out, q)
        NATIVE.attend(q.data_ptr(), out.data_ptr(), 0, _addr(self._k_base[layer]), _addr(self._v_base[layer]),
                      self._batch.slots.data_ptr(), _addr(self._q_start), _addr(self._batch.starts),
                      _addr(self._kv_len), len(self._kv_len), q.shape[1], self.hkv, self.d, True, self.d**-0.5, 0,
                      quant.kernel_threads())
        return out


def buffer_attention(q: torch.Tensor, query_lens: Sequence[int], keys: Sequence[torch.Tensor],
                     values: Sequence[torch.Tensor], *, causal: bool = True,
                     need_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """keys[b], values[b]: [L_b, Hkv, D] contiguous float32, sequence b's keys in order."""
    if not keys or len(keys) != len(values):
        raise ValueError(f"{len(keys)} keys and {len(values)} values: one of each per sequence")
    hkv, d = keys[0].shape[1:] if keys[0].dim() == 3 else (0, 0)
    k_ptrs, v_ptrs, kv_lens = array("q"), array("q"), array("q")
    for k, v in zip(keys, values):
        if k.dim() != 3 or k.shape != v.shape or k.shape[1:] != (hkv, d) or hkv == 0 \
                or not (_is_cpu_float32(k) and _is_cpu_float32(v)):
            raise ValueError(f"keys and values must be contiguous float32 [L, Hkv, D] CPU tensors of one Hkv and D, "
                             f"got {k.dtype} {tuple(k.shape)} and {v.dtype} {tuple(v.shape)}")
        kv_lens.append(k.shape[0])
        k_ptrs.append(k.data_ptr())
        v_ptrs.append(v.data_ptr())
    _check_q(q, query_lens, hkv, d)
    out, lse = _outputs(q, query_lens, kv_lens, causal, need_lse)
    if NATIVE is None:
        return _reference(q, query_lens, keys, values, causal, need_lse)
    q_start, kv_start = _offsets(query_lens), _offsets(kv_lens)
    NATIVE.attend(q.data_ptr(), out.data_ptr(), lse.data_ptr() if lse is not None else 0, _addr(k_ptrs),
                  _addr(v_ptrs), 0, _addr(q_start), _addr(kv_start), 0, len(keys), q.shape[1], hkv, d, causal,
                  d**-0.5, 0, quant.kernel_threads())
    return out, lse


class BufferBatch:
    """A step's sequences whose KV lives in buffers of their own, addressed once per step.

    buffers[b]: [num_layers, 2, capacity_b, Hkv, D] contiguous float32 (K of layer l at
    [l, 0], V at [l, 1]: the local engine's layout), holding held_lens[b] tokens, to
    which this step appends query_lens[b] new ones. Every check and every address is
    done here, so that each layer then takes one `append` and one `attend` call
    whatever the number of sequences. The buffers must not be replaced or resized
    until the step ends (the engine reserves room before a step)."""

    def __init__(self, buffers: Sequence[torch.Tensor], held_lens: Sequence[int], query_lens: Sequence[int]) -> None:
        if not buffers or not len(buffers) == len(held_lens) == len(query_lens):
            raise ValueError(f"{len(buffers)} buffers, {len(held_lens)} held lengths, {len(query_lens)} query lengths")
        shape = buffers[0].shape
        if len(shape) != 5 or shape[1] != 2 or 0 in (shape[0], shape[3], shape[4]):
            raise ValueError(f"a KV buffer must be [num_layers, 2, capacity, Hkv, D], got {tuple(shape)}")
        self.num_layers, _, _, self.hkv, self.d = shape
        for buf, held, n in zip(buffers, held_lens, query_lens):
            if buf.dim() != 5 or buf.shape[:2] != shape[:2] or buf.shape[3:] != shape[3:] or not _is_cpu_float32(buf):
                raise ValueError(f"KV buffers must be contiguous float32 CPU tensors [{self.num_layers}, 2, capacity, "
                                 f"{self.hkv}, {self.d}], got {buf.dtype} {tuple(buf.shape)}")
            if held < 0 or n < 0 or held + n > buf.shape[2]:
                raise ValueError(f"{held} held and {n} new tokens do not fit a buffer of {buf.shape[2]}")
        self._buffers = list(buffers)  # keeps the memory the addresses point to alive
        self.held_lens = array("q", held_lens)
        self.query_lens = list(query_lens)
        self.kv_lens = array("q", (h + n for h, n in zip(held_lens, query_lens)))
        self._q_start = _offsets(query_lens)
        row = self.hkv * self.d * 4  # bytes per token and layer
        # K and V addresses of every sequence, layer-major ([num_layers, B]): one layer's
        # are a contiguous run, handed to the kernel as they are.
        self._k_base, self._v_base = array("q"), array("q")
        for layer in range(self.num_layers):
            for buf in buffers:
                k = buf.data_ptr() + layer * 2 * buf.shape[2] * row
                self._k_base.append(k)
                self._v_base.append(k + buf.shape[2] * row)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} of {self.num_layers}")

    def _layer(self, bases: array, layer: int) -> int:
        return _addr(bases) + layer * len(self._buffers) * bases.itemsize

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, Hkv, D], the new tokens of every sequence in order: stored after
        each sequence's held tokens."""
        self._check_layer(layer)
        rows = self._q_start[-1]
        for t in (k, v):
            if t.shape != (rows, self.hkv, self.d) or not _is_cpu_float32(t):
                raise ValueError(f"new K and V must be contiguous float32 [{rows}, {self.hkv}, {self.d}] CPU tensors, "
                                 f"got {t.dtype} {tuple(t.shape)}")
        if NATIVE is None:
            for buf, h, s, e in zip(self._buffers, self.held_lens, self._q_start, self._q_start[1:]):
                buf[layer, 0, h : h + e - s] = k[s:e]
                buf[layer, 1, h : h + e - s] = v[s:e]
            return
        for src, bases in ((k, self._k_base), (v, self._v_base)):
            NATIVE.append_rows(src.data_ptr(), self._layer(bases, layer), _addr(self.held_lens), _addr(self._q_start),
                               len(self._buffers), self.hkv * self.d)

    def keys_values(self, layer: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence b's keys and values of one layer, held and new: [L_b, Hkv, D] views."""
        return self._buffers[b][layer, 0, : self.kv_lens[b]], self._buffers[b][layer, 1, : self.kv_lens[b]]

    def attend(self, layer: int, q: torch.Tensor, *, causal: bool = True, need_lse: bool = False,
               out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of the new tokens' queries (q: [T, Hq, D]) over every token of their
        sequence, the new ones appended first. Returns out [T, Hq, D] (written into `out`
        when given and the native kernel is built: a contiguous float32 tensor of q's
        shape, none of it q) and lse [T, Hq]."""
        self._check_layer(layer)
        _check_q(q, self.query_lens, self.hkv, self.d)
        out, lse = _outputs(q, self.query_lens, self.kv_lens, causal, need_lse, out)
        if NATIVE is None:
            keys, values = zip(*(self.keys_values(layer, b) for b in range(len(self._buffers))))
            return _reference(q, self.query_lens, keys, values, causal, need_lse)
        NATIVE.attend(q.data_ptr(), out.data_ptr(), lse.data_ptr() if lse is not None else 0,
                      self._layer(self._k_base, layer), self._layer(self._v_base, layer), 0, _addr(self._q_start), 0,
                      _addr(self.kv_lens), len(self._buffers), q.shape[1], self.hkv, self.d, causal, self.d**-0.5, 0,
                      quant.kernel_threads())
        return out, lse


def _reference(q, query_lens, keys, values, causal, need_lse):
    """The torch path: `attention_with_lse` per sequence (the definition the kernel meets)."""
    outs, lses = [], []
    start = 0
    for n, k, v in zip(query_lens, keys, values):
        qq = q[start : start + n]  # [n, Hq, D]
        if k.shape[0] == 0:
            outs.append(torch.zeros_like(qq))
            lses.append(torch.full(qq.shape[:2], float("-inf")))
        else:
            out, lse = attention_with_lse(qq, k, v, causal=causal)
            outs.append(out)
            lses.append(lse)
        start += n
    out = torch.cat(outs) if outs else torch.empty_like(q)
    return out, (torch.cat(lses) if lses else torch.empty(q.shape[:2])) if need_lse else None
