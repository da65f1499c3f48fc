"""lamina.model.paged_decode: the attention workers' Triton kernel over 1-token pages.

On a GPU the kernel is compiled; elsewhere the same kernel runs under Triton's
interpreter on CPU tensors, so these checks run on every machine that has triton
installed (the dev extra installs it)."""

from __future__ import annotations

import pytest
import torch
from triton_helpers import KERNEL_DEVICES

from lamina.model.kv_attention import SlotBatch, slot_attention

pytest.importorskip("triton", reason="needs triton (pip install '.[dev]' installs it)")

from lamina.model.attention import causal_attention
from lamina.model.paged_decode import (
    BLOCK_N,
    BufferRows,
    PagedSlots,
    attend_buffers,
    paged_attention,
    plan_splits,
)

DEVICES = KERNEL_DEVICES


def _scattered(lens: list[int], hkv: int, d: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    """Pools [S, Hkv, D] with slot 0 NaN (held by no sequence: never read) and each
    sequence's slots scattered over the rest; the batch of them."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lens) + 40
    k_pool = torch.randn(total, hkv, d, generator=gen).to(dtype)
    v_pool = torch.randn(total, hkv, d, generator=gen).to(dtype)
    k_pool[0], v_pool[0] = float("nan"), float("nan")
    order = (torch.randperm(total - 1, generator=gen) + 1).tolist()
    per_seq, start = [], 0
    for n in lens:
        per_seq.append(order[start:start + n])
        start += n
    return k_pool, v_pool, SlotBatch.build(per_seq, total)


@pytest.mark.parametrize(("query_lens", "causal", "kv_lens"), [
    ([1, 1, 0, 1], True, None),  # decode, an empty sequence among them
    ([3, 2, 0, 4], True, None),  # several new tokens each, causal
    ([1, 1, 1, 1], False, [4, 16, 0, 139]),  # Q-early's held part: a prefix of each, one holding none
])
@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("device", DEVICES)
def test_the_kernel_equals_the_native_kernel_over_scattered_slots(query_lens, causal, kv_lens, splits, device):
    """Out and lse (-inf where a query sees nothing) as the CPU's native kernel gives them on
    the same float32 pools and slots, whether a row's keys are one split or several."""
    k_pool, v_pool, batch = _scattered([5, 17, 0, 140], hkv=3, d=64)
    q = torch.randn(sum(query_lens), 9, 64, generator=torch.Generator().manual_seed(1))
    out, lse = slot_attention(q, query_lens, k_pool, v_pool, batch, kv_lens, causal=causal)
    got, got_lse = paged_attention(q.to(device), query_lens, k_pool.to(device), v_pool.to(device),
                                   PagedSlots.of(batch, device), kv_lens, causal=causal, splits=splits)
    assert got.device.type == device and got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), out, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got_lse.cpu(), lse, atol=2e-6, rtol=1e-5)
    assert paged_attention(q.to(device), query_lens, k_pool.to(device), v_pool.to(device),
                           PagedSlots.of(batch, device), kv_lens, causal=causal, need_lse=False)[1] is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("device", DEVICES)
def test_half_precision_pools_attend_as_sdpa_does(dtype, device):
    """Decode rows over bfloat16 or float16 pools: as SDPA over each sequence's gathered keys
    (grouped-query heads), within the dtype's rounding; the output in q's dtype."""
    lens = [1, 33, 200, 64]
    k_pool, v_pool, batch = _scattered(lens, hkv=2, d=128, dtype=dtype, seed=2)
    q = torch.randn(len(lens), 8, 128, generator=torch.Generator().manual_seed(3)).to(dtype)
    got, got_lse = paged_attention(q.to(device), [1] * len(lens), k_pool.to(device), v_pool.to(device),
                                   PagedSlots.of(batch, device), splits=2)
    assert got.dtype == dtype and got_lse.dtype == torch.float32
    start = 0
    for b, n in enumerate(lens):
        slots = batch.slots[start:start + n]
        start += n
        k = k_pool[slots].float().transpose(0, 1)  # [Hkv, n, D]
        v = v_pool[slots].float().transpose(0, 1)
        want = torch.nn.functional.scaled_dot_product_attention(
            q[b].float()[:, None, :], k, v, enable_gqa=True)[:, 0]  # [Hq, D]
        torch.testing.assert_close(got[b].cpu().float(), want, atol=2e-2, rtol=2e-2)
        scores = (q[b].float().view(2, 4, 128) @ k.transpose(1, 2)).flatten(0, 1) * 128**-0.5  # [Hq, n]
        torch.testing.assert_close(got_lse[b].cpu(), torch.logsumexp(scores, -1), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("held", "query_lens"), [([0, 7, 130], [1, 1, 1]), ([4, 0, 60], [3, 5, 2])])
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("device", DEVICES)
def test_the_engines_buffers_take_new_rows_and_attend_as_sdpa_does(dtype, held, query_lens, splits, device):
    """The local engine's per-sequence buffers ([layers, 2, cap, Hkv, D], caps of their own):
    a layer's new K, V rows land at each sequence's next positions (that layer only), and
    each query row attends causally over its sequence as the engine's SDPA path does."""
    gen = torch.Generator().manual_seed(4)
    layers, hkv, d, hq = 3, 2, 64, 6
    buffers = [torch.randn(layers, 2, h + n + extra, hkv, d, generator=gen).to(dtype).to(device)
               for h, n, extra in zip(held, query_lens, (5, 0, 17))]
    before = [b.clone() for b in buffers]
    t = sum(query_lens)
    q, k, v = (torch.randn(t, heads, d, generator=gen).to(dtype).to(device) for heads in (hq, hkv, hkv))
    rows = BufferRows.of(buffers, held, query_lens)
    out = attend_buffers(1, q, k, v, rows, splits=splits)
    assert out.dtype == dtype and out.device.type == device
    start = 0
    for b, (h, n) in enumerate(zip(held, query_lens)):
        want_buf = before[b].clone()
        want_buf[1, 0, h:h + n], want_buf[1, 1, h:h + n] = k[start:start + n], v[start:start + n]
        assert torch.equal(buffers[b], want_buf)  # the new rows, at layer 1 only
        want = causal_attention(q[start:start + n].float(), want_buf[1, 0, :h + n].float(),
                                want_buf[1, 1, :h + n].float())
        tol = {"atol": 2e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
        torch.testing.assert_close(out[start:start + n].float(), want, **tol)
        start += n
    with pytest.raises(ValueError, match="do not fit its buffer"):
        BufferRows.of(buffers, [h + 30 for h in held], query_lens)
    with pytest.raises(ValueError, match="do not fit"):
        attend_buffers(0, q[:, :5], k, v, rows)  # 5 query heads over 2 KV heads


def test_a_bad_call_is_refused():
    k_pool, v_pool, batch = _scattered([4, 6], hkv=3, d=64)
    slots = PagedSlots.of(batch, "cpu")
    q = torch.randn(2, 9, 64)
    with pytest.raises(ValueError, match="kv_lens must not exceed"):
        paged_attention(q, [1, 1], k_pool, v_pool, slots, [5, 6])
    with pytest.raises(ValueError, match="more queries than keys"):
        paged_attention(torch.randn(7, 9, 64), [5, 2], k_pool, v_pool, slots)
    with pytest.raises(ValueError, match="do not fit"):
        paged_attention(torch.randn(2, 8, 64), [1, 1], k_pool, v_pool, slots)  # 8 heads over 3 KV heads
    with pytest.raises(ValueError, match=r"query_lens \[1, 1\] do not fit q \(3, 9, 64\)"):
        paged_attention(torch.randn(3, 9, 64), [1, 1], k_pool, v_pool, slots)  # a row no sequence has


def test_splits_fill_the_multiprocessors_and_no_split_is_shorter_than_a_block():
    assert plan_splits(rows=1, kv_heads=8, longest=8192, multiprocessors=132) == 66  # 528 programs
    assert plan_splits(rows=64, kv_heads=8, longest=2048, multiprocessors=132) == 2
    assert plan_splits(rows=256, kv_heads=8, longest=8192, multiprocessors=132) == 1
    assert plan_splits(rows=1, kv_heads=8, longest=100, multiprocessors=132) == 2  # 100 keys: two blocks at most
    assert plan_splits(rows=1, kv_heads=8, longest=BLOCK_N, multiprocessors=132) == 1
    assert plan_splits(rows=4, kv_heads=1, longest=0, multiprocessors=132) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_the_combine_of_many_splits_is_their_log_sum_exp(device):
    """combine_splits, one launch, against torch's log-sum-exp combine: 37 splits (read 16
    at a time), a head dim that is not a power of two, splits without keys among them
    (lse -inf) and a row none of whose splits saw a key (out 0, lse -inf)."""
    from lamina.model import paged_decode_kernel
    from lamina.model.paged_decode import COMBINE_BLOCK

    gen = torch.Generator().manual_seed(5)
    t, h, s, d = 3, 4, 37, 24
    parts = torch.randn(t, h, s, d, generator=gen).to(device)
    part_lse = (torch.randn(t, h, s, generator=gen) * 4).to(device)
    part_lse[0, 1, ::3] = float("-inf")
    part_lse[2, 3] = float("-inf")
    parts[part_lse == float("-inf")] = 0.0  # what the split kernel writes where it saw no key
    out = torch.empty(t, h, d, dtype=torch.bfloat16, device=device)
    lse = torch.empty(t, h, device=device)
    paged_decode_kernel.combine_splits[(t * h,)](parts, part_lse, out, lse, s, D=d, D_PAD=32,
                                                 S_BLOCK=COMBINE_BLOCK)
    want_lse = torch.logsumexp(part_lse, dim=-1)
    weight = torch.exp(part_lse - want_lse.masked_fill(want_lse == float("-inf"), 0.0)[..., None])
    want = (weight[..., None] * parts).sum(dim=2)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, want.to(torch.bfloat16))
    assert lse[2, 3] == float("-inf") and not out[2, 3].any()


@pytest.mark.parametrize("device", DEVICES)
def test_a_long_row_split_many_ways_attends_as_sdpa_does(device):
    """2,600 keys in 41 splits of one block each: the splits' combine reads them in three
    blocks of 16."""
    k_pool, v_pool, batch = _scattered([2600], 2, 32, seed=3)
    q = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(4))
    out, _ = paged_attention(q.to(device), [1], k_pool.to(device), v_pool.to(device), PagedSlots.of(batch, device),
                             splits=41)
    keys = k_pool[batch.slots]  # [2600, Hkv, D] in the sequence's order
    values = v_pool[batch.slots]
    want = causal_attention(q, keys, values)
    torch.testing.assert_close(out.cpu(), want, rtol=2e-5, atol=2e-5)
