"""Attention over a slab pool's 1-token pages by a Triton kernel: the attention workers'
path on a GPU, where the native kernel (lamina.model.kv_attention, CPU float32) does not
run and the portable one (lamina.model.device_attention) would gather every key.

Why a kernel of our own: the slab allocator hands out single token slots, so a
sequence's keys are a page table of 1-token pages. PyTorch's flex attention pages KV in
blocks of its own tile size (a mask over the whole slab instead would score every query
against every slot), and FlashInfer's batch decode, which takes 1-token pages, compiles
its kernels with nvcc on first use and needs wheels of its own for the GPU machines'
CUDA 13 torch; Triton ships with that torch, and its interpreter runs this same kernel
on the CPU, so CI checks it against SDPA and the portable path on every commit.

The batch's slots are laid out once per step (`PagedSlots`: every sequence's slots in
order, no padding). Each layer is one launch over (query row, KV head, split of the
row's keys): a KV head's query heads share each key they read (grouped-query attention),
and long rows are split so that a small batch still fills the GPU (flash-decoding); the
splits' partial results are combined by their log-sum-exp. Outputs are as
`padded_attention`'s: out [T, Hq, D] in q's dtype and lse [T, Hq] float32, -inf (with
out 0) for a query that sees no key, so partials combine exactly (Q-early).

A decode step replayed as a CUDA graph (lamina.model.step_graphs) reads its rows from
tables filled before each replay, whose padding rows write nothing and see no key:
`SlabRows` and `attend_slab` over the slab (one launch writes the new K, V rows into
their slots, then the same kernel), `BufferRows` over the engine's buffers.

The local engine's decode steps on a GPU take the same kernel over each sequence's own
KV buffer instead of the slab (`BufferRows`, `attend_buffers`: the buffers addressed
by their device addresses), after one more launch that writes the step's new K, V rows
into them: two launches a layer for the whole batch, where SDPA per sequence takes a
handful per sequence.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.util import find_spec
from typing import Any

import torch

from lamina.model.device_attention import check_rows, visible_keys
from lamina.model.kv_attention import SlotBatch
from lamina.model.uploads import upload

# Keys per block of the kernel's loop (a dot's tile: at least 16).
BLOCK_N = 64
# A launch aims at this many programs per multiprocessor before it splits rows further.
PROGRAMS_PER_SM = 4
# Splits the combine reads at a time (paged_decode_kernel.combine_splits).
COMBINE_BLOCK = 16


def paged_available(device: torch.device | str) -> bool:
    """Whether the kernel serves pools on `device`: a CUDA device where triton is installed."""
    return torch.device(device).type == "cuda" and find_spec("triton") is not None


@dataclass(frozen=True)
class PagedSlots:
    """A SlotBatch as a page table of 1-token pages on the pools' device, built once per step."""

    slots: torch.Tensor  # int32 [N]: every sequence's slots, in order, one after another
    starts: tuple[int, ...]  # where each sequence's slots start in `slots`
    lens: tuple[int, ...]  # keys per sequence
    device: torch.device
    # Per (query_lens, kv_lens, causal): each query row's start and key count on the device,
    # and the most keys a row sees. The same for every layer of a step, so made once.
    _rows: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, batch: SlotBatch, device: torch.device | str) -> PagedSlots:
        starts = [0]
        for n in batch.lens[:-1]:
            starts.append(starts[-1] + n)
        return cls(upload(batch.slots.to(torch.int32), device), tuple(starts), batch.lens, torch.device(device))

    def rows(self, query_lens: Sequence[int], kv_lens: Sequence[int] | None,
             causal: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
        key = (tuple(query_lens), None if kv_lens is None else tuple(kv_lens), causal)
        hit = self._rows.get(key)
        if hit is None:
            seq_of_row, visible = visible_keys(query_lens, self.lens, kv_lens, causal)  # [T] each
            start = torch.tensor(self.starts, dtype=torch.int64)[seq_of_row]  # [T]
            hit = (upload(start, self.device), upload(visible, self.device),
                   int(visible.max()) if visible.numel() else 0)
            self._rows[key] = hit
        return hit


def _kernels(device: torch.device) -> Any:
    """The kernels' module: compiled for a GPU, or for CPU tensors run by Triton's
    interpreter, which triton gives where TRITON_INTERPRET=1 was set before it was first
    imported."""
    from lamina.model import paged_decode_kernel

    if device.type == "cpu" and type(paged_decode_kernel.paged_decode).__name__ != "InterpretedFunction":
        raise ValueError("the paged kernels run on CPU tensors only under Triton's interpreter: "
                         "set TRITON_INTERPRET=1 before triton is imported")
    return paged_decode_kernel


def _current(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """`device` made current for a launch: Triton launches on the current device's current
    stream, whatever device the tensors are on."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The device's streaming multiprocessors (1 for the CPU): what splits fill."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def plan_splits(rows: int, kv_heads: int, longest: int, multiprocessors: int) -> int:
    """Into how many splits each row's keys go: enough programs to give every
    multiprocessor PROGRAMS_PER_SM, no split shorter than a block."""
    if longest <= 0:
        return 1
    wanted = math.ceil(PROGRAMS_PER_SM * multiprocessors / max(rows * kv_heads, 1))
    return max(1, min(wanted, math.ceil(longest / BLOCK_N)))


def paged_attention(q: torch.Tensor, query_lens: Sequence[int], k_pool: torch.Tensor, v_pool: torch.Tensor,
                    slots: PagedSlots, kv_lens: Sequence[int] | None = None, *, causal: bool = True,
                    need_lse: bool = True, splits: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q: [T, Hq, D] (T = sum(query_lens)); k_pool, v_pool: [S, Hkv, D] float32, bfloat16
    or float16 on q's device. Sequence b attends over its first kv_lens[b] slots (default:
    all); with `causal`, its i-th of n queries sees keys 0 .. L - n + i. `splits`: into
    how many pieces a row's keys go (default: enough to fill the GPU)."""
    check_rows(query_lens, q)  # the kernel reads a row's start and length for each of q's rows
    row_start, row_len, longest = slots.rows(query_lens, kv_lens, causal)
    return _paged(q, k_pool, v_pool, slots.slots, row_start, row_len, longest, need_lse, splits)


def _check_pools(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
    hq, hkv = q.shape[1], k_pool.shape[1]
    if hq % hkv or k_pool.stride(2) != 1 or v_pool.stride(2) != 1 or k_pool.dtype != v_pool.dtype \
            or k_pool.shape[1:] != v_pool.shape[1:] or k_pool.shape[2] != q.shape[2]:
        raise ValueError(f"pools {tuple(k_pool.shape)} / {tuple(v_pool.shape)} do not fit q {tuple(q.shape)}")


def _paged(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, row_start: torch.Tensor,
           row_len: torch.Tensor, longest: int, need_lse: bool, splits: int | None
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The paged kernel and the splits' combine: q [T, Hq, D]; slots int32 [N]; row_start,
    row_len int64 [T] (where each row's keys start in `slots`, how many it sees); longest:
    the most keys a row sees (the splits cover that many)."""
    _check_pools(q, k_pool, v_pool)
    _, _, d = q.shape
    hkv = k_pool.shape[1]
    q = q.contiguous()

    def launch(kernels: Any, grid: tuple[int, int, int], parts: torch.Tensor, part_lse: torch.Tensor,
               chunk: int, shape: dict[str, Any]) -> None:
        kernels.paged_decode[grid](
            q, k_pool, v_pool, slots, row_start, row_len, parts, part_lse,
            q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
            chunk, d**-0.5, **shape)

    return _split_and_combine(q, hkv, longest, k_pool.dtype, launch, need_lse, splits)


@dataclass(frozen=True)
class SlabRows:
    """A decode step's rows over a slab pool's 1-token pages, as a CUDA graph reads them
    (lamina.model.step_graphs): every sequence has one new token, whose K, V go to its
    last slot, and its query sees all of its keys. The three int64 rows of one table
    ([3, T]: `table`), and the slots, on the pools' device."""

    start: torch.Tensor  # int64 [T]: where each row's sequence starts in `slots`
    visible: torch.Tensor  # int64 [T]: the keys it sees (all its sequence's)
    new: torch.Tensor  # int64 [T]: the slot its new K, V are written to (-1: none, a padding row)
    slots: torch.Tensor  # int32 [N]: every sequence's slots, in order, one after another
    longest: int  # the most keys a row sees (a CUDA graph's: the most its splits cover)

    @staticmethod
    def table(lens: Sequence[int], slots: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """int64 [3, rows] on the CPU (start, visible, new), for sequences of `lens` keys
        each (their new token included) whose slots are `slots` (int64 [sum(lens)], in
        order). `rows` (default one per sequence) pads the table with rows that write
        nothing and see no key."""
        b = len(lens)
        if any(n < 1 for n in lens) or sum(lens) != slots.numel():
            raise ValueError(f"{slots.numel()} slots for sequences of {list(lens)[:8]} keys (each at least 1)")
        if rows is not None and rows < b:
            raise ValueError(f"{b} rows do not fit a table of {rows}")
        out = torch.zeros(3, b if rows is None else rows, dtype=torch.int64)  # [3, rows]
        out[2] = -1
        if b:
            ends = torch.tensor(lens, dtype=torch.int64).cumsum(0)  # [B]
            out[1, :b] = torch.tensor(lens, dtype=torch.int64)
            out[0, :b] = ends - out[1, :b]
            out[2, :b] = slots[ends - 1]
        return out

    @classmethod
    def over(cls, table: torch.Tensor, slots: torch.Tensor, longest: int) -> SlabRows:
        """Rows read from a table on the device (int64 [3, T]: `table`'s layout) over
        `slots` (int32 [N] there)."""
        return cls(table[0], table[1], table[2], slots, longest)


def attend_slab(k_pool: torch.Tensor, v_pool: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                rows: SlabRows, splits: int | None = None) -> torch.Tensor:
    """A decode step's layer over a slab pool, for a CUDA graph: the new rows' k, v
    [T, Hkv, D] written into their slots of the pools [S, Hkv, D] (one launch; padding
    rows write nothing), then attention of q [T, Hq, D] over each row's sequence (one
    launch, and the splits' combine). Returns out [T, Hq, D] in q's dtype."""
    t, _, d = q.shape
    _check_pools(q, k_pool, v_pool)
    hkv = k_pool.shape[1]
    if k.shape != (t, hkv, d) or v.shape != k.shape or rows.new.numel() != t:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not fit "
                         f"{rows.new.numel()} rows over pools of {hkv} KV heads")
    k, v = k.contiguous(), v.contiguous()
    if t:
        with _current(q.device):
            _kernels(q.device).slab_append[(t,)](k, v, k_pool, v_pool, rows.new, k.stride(0), v.stride(0),
                                                 k_pool.stride(0), v_pool.stride(0), HKV=hkv,
                                                 H_PAD=triton_pow2(hkv), D=d, D_PAD=triton_pow2(d))
    return _paged(q, k_pool, v_pool, rows.slots, rows.start, rows.visible, rows.longest, False, splits)[0]


def products_in_float32(kv_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernels take their products in float32 (F32_DOTS) rather than in the
    KV's dtype: for float32 KV, and on CPU tensors, whose Triton interpreter gets
    half-precision products wrong (the tests' tolerances for half precision cover it)."""
    return kv_dtype == torch.float32 or device.type == "cpu"


def _split_and_combine(q: torch.Tensor, hkv: int, longest: int, kv_dtype: torch.dtype, launch: Any,
                       need_lse: bool, splits: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plans the splits, launches (launch(kernels, grid, parts, part_lse, chunk, shape))
    and combines the splits' partial results by their log-sum-exp: out [T, Hq, D] in q's
    dtype, lse [T, Hq] float32 (or None)."""
    t, hq, d = q.shape
    if splits is None:
        splits = plan_splits(t, hkv, longest, multiprocessors(q.device))
    chunk = max(BLOCK_N, math.ceil(math.ceil(longest / splits) / BLOCK_N) * BLOCK_N)
    splits = max(1, math.ceil(longest / chunk))
    parts = torch.empty(t, hq, splits, d, dtype=torch.float32, device=q.device)  # [T, Hq, splits, D]
    part_lse = torch.empty(t, hq, splits, dtype=torch.float32, device=q.device)  # [T, Hq, splits]
    if t:
        kernels = _kernels(q.device)
        g = hq // hkv
        shape = {"G": g, "G_PAD": max(16, triton_pow2(g)), "D": d, "D_PAD": max(16, triton_pow2(d)),
                 "BLOCK_N": BLOCK_N, "F32_DOTS": products_in_float32(kv_dtype, q.device)}
        with _current(q.device):
            launch(kernels, (t, hkv, splits), parts, part_lse, chunk, shape)
    if splits == 1 or not t:
        return parts[:, :, 0].to(q.dtype), part_lse[:, :, 0] if need_lse else None
    out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)  # [T, Hq, D]
    lse = torch.empty(t, hq, dtype=torch.float32, device=q.device)  # [T, Hq]; -inf where no split saw a key
    with _current(q.device):
        kernels.combine_splits[(t * hq,)](parts, part_lse, out, lse, splits, D=d, D_PAD=max(16, triton_pow2(d)),
                                          S_BLOCK=COMBINE_BLOCK)
    return out, lse if need_lse else None


@dataclass(frozen=True)
class BufferRows:
    """One step's rows over the local engine's per-sequence KV buffers
    ([num_layers, 2, cap, Hkv, D] each, lamina.engine.kv.SequenceKV), on their device,
    built once per step: where each new row is written, and what each query row reads.
    The four are the rows of one int64 [4, T] table (`table`), uploaded in one copy."""

    base: torch.Tensor  # int64 [T]: the address of each row's sequence buffer
    cap: torch.Tensor  # int64 [T]: that buffer's capacity in tokens
    pos: torch.Tensor  # int64 [T]: the position each new row is written at
    visible: torch.Tensor  # int64 [T]: the keys each query row sees (causal), its own included
    longest: int  # the most keys a row sees (a CUDA graph's: the most its splits cover)
    dtype: torch.dtype  # the buffers'
    num_kv_heads: int

    @staticmethod
    def table(buffers: Sequence[torch.Tensor], held: Sequence[int], query_lens: Sequence[int],
              rows: int | None = None) -> torch.Tensor:
        """int64 [4, rows] on the CPU: each new row's base, cap, pos and visible (above),
        in row order. buffers: each sequence's buffer (contiguous, all of one dtype on one
        device, big enough for its new rows); held: the tokens each holds before the
        step; query_lens: its new rows, which are its next positions and its queries.
        `rows` (default: the new rows) pads the table with rows of zeros, which write
        nothing and see no key (a CUDA graph's rows past the step's)."""
        if not buffers or len(buffers) != len(held) or len(held) != len(query_lens):
            raise ValueError("one buffer, one held length and one query length per sequence")
        first = buffers[0]
        if any(b.dtype != first.dtype or b.device != first.device or not b.is_contiguous()
               or b.shape[3:] != first.shape[3:] or b.shape[:2] != first.shape[:2] for b in buffers):
            raise ValueError("the buffers must be contiguous, of one shape but capacity, dtype and device")
        if any(h + n > b.shape[2] for b, h, n in zip(buffers, held, query_lens)):
            raise ValueError("a sequence's new rows do not fit its buffer")
        t = sum(query_lens)
        if rows is not None and rows < t:
            raise ValueError(f"{t} new rows do not fit a table of {rows}")
        # Python lists, one tensor at the end: per-sequence tensor writes would cost a
        # few operators a sequence on every step.
        base: list[int] = []
        cap: list[int] = []
        pos: list[int] = []
        visible: list[int] = []
        for b, h, n in zip(buffers, held, query_lens):
            base += [b.data_ptr()] * n
            cap += [b.shape[2]] * n
            pos += range(h, h + n)
            visible += range(h + 1, h + n + 1)
        pad = [0] * ((t if rows is None else rows) - t)
        return torch.tensor([base + pad, cap + pad, pos + pad, visible + pad], dtype=torch.int64)  # [4, rows]

    @classmethod
    def of(cls, buffers: Sequence[torch.Tensor], held: Sequence[int], query_lens: Sequence[int]) -> BufferRows:
        """The step's rows on the buffers' device (`table`'s arguments)."""
        table = cls.table(buffers, held, query_lens)
        longest = int(table[3].max()) if table.shape[1] else 0
        return cls.over(upload(table, buffers[0].device), longest, buffers[0].dtype, buffers[0].shape[3])

    @classmethod
    def over(cls, table: torch.Tensor, longest: int, dtype: torch.dtype, num_kv_heads: int) -> BufferRows:
        """Rows read from a table on the device (int64 [4, T]: `table`'s layout)."""
        return cls(table[0], table[1], table[2], table[3], longest, dtype, num_kv_heads)


def attend_buffers(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: BufferRows,
                     splits: int | None = None) -> torch.Tensor:
    """The engine's step on a GPU, one layer: the new rows' k, v [T, Hkv, D] written into
    their sequences' buffers (one launch), then causal attention of q [T, Hq, D] over each
    sequence's buffer (one launch, and the splits' combine). Returns out [T, Hq, D] in q's dtype."""
    t, hq, d = q.shape
    hkv = rows.num_kv_heads
    if k.shape != (t, hkv, d) or v.shape != k.shape or hq % hkv or rows.base.numel() != t:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not fit "
                         f"{rows.base.numel()} rows of {hkv} KV heads")
    from triton import language as tl

    kv = getattr(tl, str(rows.dtype).removeprefix("torch."))
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if t:
        with _current(q.device):
            _kernels(q.device).buffer_append[(t,)](
                k, v, rows.base, rows.cap, rows.pos, layer, k.stride(0), v.stride(0),
                KV=kv, HKV=hkv, H_PAD=triton_pow2(hkv), D=d, D_PAD=triton_pow2(d))

    def launch(kernels: Any, grid: tuple[int, int, int], parts: torch.Tensor, part_lse: torch.Tensor,
               chunk: int, shape: dict[str, Any]) -> None:
        kernels.buffer_decode[grid](q, rows.base, rows.cap, rows.visible, layer, parts, part_lse,
                                    q.stride(0), q.stride(1), chunk, d**-0.5, KV=kv, HKV=hkv, **shape)

    return _split_and_combine(q, hkv, rows.longest, rows.dtype, launch, False, splits)[0]


def triton_pow2(n: int) -> int:
    """The smallest power of two at least n (a Triton block's length)."""
    return 1 << max(n - 1, 0).bit_length()
