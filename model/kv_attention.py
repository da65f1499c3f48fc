"""Attention of a whole batch over KV read where it is stored: one call per layer.

Two ways KV is stored, one kernel (csrc/kv_attention.c, built into
`model._kv_attention`; `NATIVE` is None where it could not be built, and the
torch reference below runs instead):

- `slot_attention`: KV in a slab pool ([S, Hkv, D] per layer, kvstore.slab), each
  sequence's keys named by their slots (a `SlotBatch`, built once per step and used
  for every layer): the attention workers' layout.
- `buffer_attention`: each sequence's keys in a buffer of its own ([L_b, Hkv, D],
  contiguous): the local engine's layout.

Both take the new tokens' queries of every sequence concatenated (q: [T, Hq, D],
`query_lens` per sequence) and return out [T, Hq, D] and, with `need_lse`, the
log-sum-exp of the scaled scores lse [T, Hq] (float32; -inf for a query that saw no
key, so its partial combines as zero: see model.attention.combine_partials). With
`causal`, query i of a sequence of n queries and L keys sees keys 0 .. L - n + i (the
queries are the last n keys); without, every key (Q-early's part over the KV held
before the step).

The kernel reads each K and V row once per KV head for all the queries that share it,
with an online softmax; it accumulates in float32 like the reference, so the two agree
to float rounding (tests/model/test_kv_attention.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from model.attention import attention_with_lse

try:
    from model import _kv_attention as NATIVE
except ImportError:  # not built (no C compiler at install): the torch reference runs
    NATIVE = None


def _check_q(q: torch.Tensor, query_lens: Sequence[int], hkv: int, d: int) -> None:
    if q.dtype != torch.float32 or q.dim() != 3 or not q.is_contiguous():
        raise ValueError(f"q must be a contiguous float32 [T, Hq, D] tensor, got {q.dtype} {tuple(q.shape)}")
    if q.shape[2] != d or q.shape[1] % hkv:
        raise ValueError(f"q {tuple(q.shape)} does not fit KV of {hkv} heads of dimension {d}")
    if sum(query_lens) != q.shape[0]:
        raise ValueError(f"query_lens add up to {sum(query_lens)}, q has {q.shape[0]} rows")


def _starts(lens: Sequence[int]) -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=torch.int64)  # [B + 1]
    if lens:
        out[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0)
    return out


def _prepare(q: torch.Tensor, query_lens: Sequence[int], kv_lens: Sequence[int], causal: bool, need_lse: bool):
    """Outputs and the int64 start offsets ([B + 1]) the kernel reads."""
    if causal and any(n > length for n, length in zip(query_lens, kv_lens)):
        raise ValueError("a sequence has more queries than keys (causal queries are its last keys)")
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32) if need_lse else None
    return out, lse, _starts(query_lens), _starts(kv_lens)


@dataclass(frozen=True)
class SlotBatch:
    """The slots of a batch's sequences, checked once and reused for every layer.

    slots: int64 [sum(lens)], each sequence's slots in position order, concatenated;
    starts: int64 [B + 1] offsets into slots; lens: tokens per sequence."""

    slots: torch.Tensor
    starts: torch.Tensor
    lens: tuple[int, ...]
    num_slots: int  # the pool size every slot is below

    @classmethod
    def build(cls, per_sequence: Sequence[Sequence[int]], num_slots: int) -> SlotBatch:
        lens = tuple(len(s) for s in per_sequence)
        slots = torch.tensor([x for seq in per_sequence for x in seq], dtype=torch.int64)
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_slots):
            raise ValueError(f"slots outside the pool of {num_slots}")
        return cls(slots, _starts(lens), lens, num_slots)


def slot_attention(q: torch.Tensor, query_lens: Sequence[int], k_pool: torch.Tensor, v_pool: torch.Tensor,
                   batch: SlotBatch, kv_lens: Sequence[int] | None = None, *, causal: bool = True,
                   need_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """k_pool, v_pool: [S, Hkv, D]; `batch` names each sequence's slots. With
    `kv_lens`, sequence b attends over its first kv_lens[b] slots only."""
    if k_pool.shape != v_pool.shape or k_pool.dim() != 3:
        raise ValueError(f"k_pool {tuple(k_pool.shape)} and v_pool {tuple(v_pool.shape)} must be [S, Hkv, D]")
    if k_pool.dtype != torch.float32 or not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError("k_pool and v_pool must be contiguous float32")
    num_slots, hkv, d = k_pool.shape
    _check_q(q, query_lens, hkv, d)
    if batch.num_slots > num_slots or len(batch.lens) != len(query_lens):
        raise ValueError(f"a slot batch of {len(batch.lens)} sequences in a pool of {batch.num_slots} does not fit "
                         f"{len(query_lens)} sequences in a pool of {num_slots}")
    lens = batch.lens if kv_lens is None else tuple(kv_lens)
    if any(not 0 <= n <= m for n, m in zip(lens, batch.lens)) or len(lens) != len(batch.lens):
        raise ValueError("kv_lens must not exceed the sequences' slots")
    out, lse, q_start, _ = _prepare(q, query_lens, lens, causal, need_lse)
    if NATIVE is None:
        keys = [k_pool[batch.slots[s : s + n]] for s, n in zip(batch.starts.tolist(), lens)]
        values = [v_pool[batch.slots[s : s + n]] for s, n in zip(batch.starts.tolist(), lens)]
        return _reference(q, query_lens, keys, values, causal, need_lse)
    b = len(lens)
    kv_len = torch.tensor(lens, dtype=torch.int64)
    k_base = torch.full((b,), k_pool.data_ptr(), dtype=torch.int64)
    v_base = torch.full((b,), v_pool.data_ptr(), dtype=torch.int64)
    NATIVE.attend(q.data_ptr(), out.data_ptr(), lse.data_ptr() if lse is not None else 0, k_base.data_ptr(),
                  v_base.data_ptr(), batch.slots.data_ptr(), q_start.data_ptr(), batch.starts.data_ptr(),
                  kv_len.data_ptr(), b, q.shape[1], hkv, d, causal, d**-0.5)
    return out, lse


def buffer_attention(q: torch.Tensor, query_lens: Sequence[int], keys: Sequence[torch.Tensor],
                     values: Sequence[torch.Tensor], *, causal: bool = True,
                     need_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """keys[b], values[b]: [L_b, Hkv, D] contiguous float32, sequence b's keys in order."""
    if not keys:
        raise ValueError("no sequences")
    hkv, d = keys[0].shape[1], keys[0].shape[2]
    _check_q(q, query_lens, hkv, d)
    if not len(query_lens) == len(keys) == len(values):
        raise ValueError(f"{len(query_lens)} query lengths for {len(keys)} keys and {len(values)} values")
    kv_lens = []
    k_ptrs, v_ptrs = [], []
    for k, v in zip(keys, values):
        if k.shape != v.shape or k.shape[1:] != (hkv, d) or k.dtype != torch.float32 \
                or not (k.is_contiguous() and v.is_contiguous()):
            raise ValueError(f"keys and values must be contiguous float32 [L, {hkv}, {d}], got {tuple(k.shape)}")
        kv_lens.append(k.shape[0])
        k_ptrs.append(k.data_ptr())
        v_ptrs.append(v.data_ptr())
    out, lse, q_start, kv_start = _prepare(q, query_lens, kv_lens, causal, need_lse)
    if NATIVE is None:
        return _reference(q, query_lens, keys, values, causal, need_lse)
    hq = q.shape[1]
    k_base = torch.tensor(k_ptrs, dtype=torch.int64)
    v_base = torch.tensor(v_ptrs, dtype=torch.int64)
    NATIVE.attend(q.data_ptr(), out.data_ptr(), lse.data_ptr() if lse is not None else 0, k_base.data_ptr(),
                  v_base.data_ptr(), 0, q_start.data_ptr(), kv_start.data_ptr(), 0, len(keys), hq, hkv, d,
                  causal, d**-0.5)
    return out, lse


def _reference(q, query_lens, keys, values, causal, need_lse):
    """The torch path: `attention_with_lse` per sequence (the definition the kernel meets)."""
    outs, lses = [], []
    start = 0
    for n, k, v in zip(query_lens, keys, values):
        qq = q[start : start + n]
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
