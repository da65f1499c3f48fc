"""A whole batch's attention over a slab pool in a handful of torch operators, on any
device and in any float dtype: the attention workers' path where the native kernel
(lamina.model.kv_attention, CPU float32 only) does not run.

The batch's slots are laid out once per step as a padded table ([B, Lmax], padding
pointing at slot 0 and masked), so each layer is one gather of K and V, two batched
products and a masked log-sum-exp, with no loop over sequences: the same arithmetic as
`lamina.model.attention.attention_with_lse` (scores and softmax in float32 whatever the
KV's dtype), and the same outputs as `slot_attention`: out [T, Hq, D] in q's dtype and
lse [T, Hq] float32, -inf (with out 0) for a query that sees no key, so partials
combine exactly (Q-early). The gather holds [T, Lmax, Hkv, D] of K and of V at once:
memory grows with the batch's longest sequence, which a paged kernel library would not
need; it is the portable path, checked against the native kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lamina.model.kv_attention import SlotBatch
from lamina.model.uploads import upload


@dataclass(frozen=True)
class PaddedSlots:
    """A SlotBatch as a padded table on the pools' device, built once per step."""

    table: torch.Tensor  # int64 [B, Lmax]: sequence b's slots, then slot 0 as padding
    lens: tuple[int, ...]  # keys per sequence
    device: torch.device

    @classmethod
    def of(cls, batch: SlotBatch, device: torch.device | str) -> PaddedSlots:
        lens = batch.lens
        width = max(lens, default=0)
        table = torch.zeros(len(lens), max(width, 1), dtype=torch.int64)  # [B, Lmax]
        if width:
            col = torch.arange(width)  # [Lmax]
            lens_t = torch.tensor(lens)  # [B]
            valid = col[None, :] < lens_t[:, None]  # [B, Lmax]
            table[:, :width][valid] = batch.slots  # row-major: each sequence's slots in order
        return cls(upload(table, device), lens, torch.device(device))


def check_rows(query_lens: Sequence[int], q: torch.Tensor) -> None:
    """q [T, Hq, D] holds exactly the sequences' query rows (T = sum(query_lens))."""
    if sum(query_lens) != q.shape[0]:
        raise ValueError(f"query_lens {list(query_lens)[:8]} do not fit q {tuple(q.shape)}")


def visible_keys(query_lens: Sequence[int], slot_lens: Sequence[int], kv_lens: Sequence[int] | None,
                 causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row's sequence and the number of keys it sees, int64 [T] each on the
    CPU: sequence b's rows see its first kv_lens[b] slots (default: all its slot_lens[b]);
    with `causal`, its i-th of n queries sees keys 0 .. L - n + i."""
    if kv_lens is not None and len(kv_lens) != len(slot_lens):
        raise ValueError(f"kv_lens must give one length per sequence ({len(kv_lens)} for {len(slot_lens)})")
    lens = tuple(slot_lens) if kv_lens is None else tuple(kv_lens)
    t = sum(query_lens)
    if len(query_lens) != len(lens):
        raise ValueError(f"query_lens {list(query_lens)[:8]} do not fit {len(lens)} sequences")
    if any(not 0 <= n <= m for n, m in zip(lens, slot_lens)):
        raise ValueError("kv_lens must not exceed the sequences' slots")
    if causal and any(n > m for n, m in zip(query_lens, lens)):
        raise ValueError("a sequence has more queries than keys (causal queries are its last keys)")
    seq_of_row = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(query_lens, dtype=torch.int64))
    offs = torch.cat([torch.arange(n) for n in query_lens]) if t else torch.zeros(0, dtype=torch.int64)  # [T]
    visible = torch.tensor(lens, dtype=torch.int64)[seq_of_row]  # [T]
    if causal:
        visible = visible - (torch.tensor(query_lens, dtype=torch.int64)[seq_of_row] - 1 - offs)
    return seq_of_row, visible


def padded_attention(q: torch.Tensor, query_lens: Sequence[int], k_pool: torch.Tensor, v_pool: torch.Tensor,
                     slots: PaddedSlots, kv_lens: Sequence[int] | None = None, *, causal: bool = True,
                     need_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q: [T, Hq, D] (T = sum(query_lens)); k_pool, v_pool: [S, Hkv, D] of any float dtype
    on q's device. Sequence b attends over its first kv_lens[b] slots (default: all);
    with `causal`, its i-th of n queries sees keys 0 .. L - n + i."""
    check_rows(query_lens, q)
    seq_of_row, visible = visible_keys(query_lens, slots.lens, kv_lens, causal)  # [T] each
    t, hq, d = q.shape
    hkv = k_pool.shape[1]
    g = hq // hkv
    device = q.device
    width = slots.table.shape[1]
    seq_of_row, visible = upload(seq_of_row, device), upload(visible, device)
    rows = slots.table[seq_of_row]  # [T, Lmax] slot of each key of each query row
    k = k_pool[rows].float()  # [T, Lmax, Hkv, D]
    v = v_pool[rows].float()
    qf = q.float().view(t, hkv, g, d)  # [T, Hkv, G, D]
    scores = torch.einsum("thgd,tlhd->thgl", qf, k) * d**-0.5  # [T, Hkv, G, Lmax]
    mask = torch.arange(width, device=device)[None, :] >= visible[:, None]  # [T, Lmax] True: not seen
    scores.masked_fill_(mask[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [T, Hkv, G]; -inf where no key is seen
    probs = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])  # 0 on masked keys
    # Padding and unseen keys read slots that may hold anything (NaN bits of a pool never
    # written): their zero weights would still turn NaN into NaN, so their values are zeroed.
    v = v.masked_fill(mask[:, :, None, None], 0.0)
    out = torch.einsum("thgl,tlhd->thgd", probs, v)  # [T, Hkv, G, D]
    out = out.reshape(t, hq, d).to(q.dtype)
    return out, lse.reshape(t, hq) if need_lse else None
