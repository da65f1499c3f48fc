"""The batched attention kernel over KV in place, against the reference operator."""

from __future__ import annotations

import pytest
import torch

from model import kv_attention
from model.attention import attention_with_lse, combine_partials
from model.kv_attention import SlotBatch, buffer_attention, slot_attention

pytestmark = pytest.mark.skipif(kv_attention.NATIVE is None,
                                reason="model/_kv_attention is not built on this machine (no C compiler at install)")


def _reference(q, query_lens, keys, values, causal=True):
    outs, lses, start = [], [], 0
    for n, k, v in zip(query_lens, keys, values):
        out, lse = attention_with_lse(q[start : start + n], k, v, causal=causal)
        outs.append(out)
        lses.append(lse)
        start += n
    return torch.cat(outs), torch.cat(lses)


def _pool(lens, hkv, d, shuffle, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_slots = sum(lens) + 7
    k_pool, v_pool = torch.randn(num_slots, hkv, d, generator=g), torch.randn(num_slots, hkv, d, generator=g)
    order = torch.randperm(num_slots, generator=g) if shuffle else torch.arange(num_slots)
    per_seq, start = [], 0
    for n in lens:
        per_seq.append(order[start : start + n].tolist())
        start += n
    return k_pool, v_pool, per_seq


@pytest.mark.parametrize(("query_lens", "kv_lens", "hq", "hkv", "d", "shuffle"), [
    ([1, 1, 1], [5, 70, 33], 9, 3, 64, False),       # decode, GQA 3
    ([1, 1], [40, 1], 4, 4, 64, True),               # no grouping, scattered slots
    ([4, 1, 6], [4, 9, 30], 6, 2, 48, True),         # causal queries (a whole prompt; a prefix + new)
    ([2, 3], [100, 3], 8, 2, 13, False),             # a head size that is no multiple of 8
])
def test_slot_attention_equals_the_reference(query_lens, kv_lens, hq, hkv, d, shuffle):
    k_pool, v_pool, per_seq = _pool(kv_lens, hkv, d, shuffle)
    q = torch.randn(sum(query_lens), hq, d)
    batch = SlotBatch.build(per_seq, k_pool.shape[0])
    out, lse = slot_attention(q, query_lens, k_pool, v_pool, batch)
    keys = [k_pool[torch.tensor(s)] for s in per_seq]
    values = [v_pool[torch.tensor(s)] for s in per_seq]
    ref_out, ref_lse = _reference(q, query_lens, keys, values)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=1e-5)
    out2, lse2 = buffer_attention(q, query_lens, [k.contiguous() for k in keys], [v.contiguous() for v in values],
                                  need_lse=False)
    assert lse2 is None
    torch.testing.assert_close(out2, out, atol=1e-6, rtol=0)


def test_prefix_partials_combine_into_the_whole():
    """Q-early: attention over the held prefix (non-causal) and over the new token,
    combined by log-sum-exp, equals attention over all of them."""
    lens = [17, 64, 3]
    k_pool, v_pool, per_seq = _pool(lens, 3, 64, shuffle=True, seed=3)
    batch = SlotBatch.build(per_seq, k_pool.shape[0])
    q = torch.randn(3, 9, 64)
    held_out, held_lse = slot_attention(q, [1, 1, 1], k_pool, v_pool, batch, [n - 1 for n in lens], causal=False)
    keys = [k_pool[torch.tensor(s)] for s in per_seq]
    values = [v_pool[torch.tensor(s)] for s in per_seq]
    new_out, new_lse = _reference(q, [1, 1, 1], [k[-1:] for k in keys], [v[-1:] for v in values])
    out, _ = combine_partials(held_out, held_lse, new_out, new_lse)
    torch.testing.assert_close(out, _reference(q, [1, 1, 1], keys, values)[0], atol=2e-5, rtol=1e-4)


def test_a_sequence_without_keys_gives_zero_and_minus_infinity():
    k_pool, v_pool, per_seq = _pool([4, 6], 2, 8, shuffle=False)
    batch = SlotBatch.build(per_seq, k_pool.shape[0])
    out, lse = slot_attention(torch.randn(2, 2, 8), [1, 1], k_pool, v_pool, batch, [0, 6], causal=False)
    assert torch.equal(out[0], torch.zeros(2, 8)) and torch.isinf(lse[0]).all() and (lse[0] < 0).all()
    assert torch.isfinite(lse[1]).all()


def test_bad_arguments_are_refused_before_the_kernel_runs():
    k_pool, v_pool, per_seq = _pool([4], 3, 8, shuffle=False)
    batch = SlotBatch.build(per_seq, k_pool.shape[0])
    q = torch.randn(1, 9, 8)
    with pytest.raises(ValueError, match="slots outside the pool"):
        SlotBatch.build([[0, 99]], k_pool.shape[0])
    with pytest.raises(ValueError, match="q must be a contiguous float32"):
        slot_attention(q.double(), [1], k_pool, v_pool, batch)
    with pytest.raises(ValueError, match="does not fit KV"):
        slot_attention(torch.randn(1, 9, 16), [1], k_pool, v_pool, batch)
    with pytest.raises(ValueError, match="query_lens add up to 2"):
        slot_attention(q, [2], k_pool, v_pool, batch)
    with pytest.raises(ValueError, match="more queries than keys"):
        slot_attention(torch.randn(5, 9, 8), [5], k_pool, v_pool, batch)
    with pytest.raises(ValueError, match="must not exceed"):
        slot_attention(q, [1], k_pool, v_pool, batch, [5])
    with pytest.raises(ValueError, match="does not fit"):
        slot_attention(q, [1], k_pool[:2].contiguous(), v_pool[:2].contiguous(), batch)
    with pytest.raises(ValueError, match="contiguous float32"):
        buffer_attention(q, [1], [k_pool[:8:2]], [v_pool[:8:2]])  # every other row: not contiguous


def test_the_torch_path_gives_the_same_results(monkeypatch):
    k_pool, v_pool, per_seq = _pool([9, 30], 3, 64, shuffle=True, seed=5)
    batch = SlotBatch.build(per_seq, k_pool.shape[0])
    q = torch.randn(3, 9, 64)
    native = slot_attention(q, [1, 2], k_pool, v_pool, batch)
    monkeypatch.setattr(kv_attention, "NATIVE", None)
    torch_path = slot_attention(q, [1, 2], k_pool, v_pool, batch)
    torch.testing.assert_close(native, torch_path, atol=2e-5, rtol=1e-4)
