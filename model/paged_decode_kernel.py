"""The Triton kernel of lamina.model.paged_decode: attention over a page table of 1-token
pages, one program per (query row, KV head, split of the row's keys).

Imported only where triton is installed (the GPU machines have it; the CPU install runs
it under Triton's interpreter in the tests). This module holds the kernel alone: its
launch, the split plan and the combine of the splits are lamina.model.paged_decode's.
"""

import triton
import triton.language as tl


@triton.jit
def paged_decode(q, k_pool, v_pool, slots, row_start, row_len, out, lse,
                 stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
                 chunk, scale,
                 G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                 BLOCK_N: tl.constexpr, F32_DOTS: tl.constexpr):
    """q: [T, Hq, D]; k_pool, v_pool: [S, Hkv, D] (last dim contiguous); slots: int32,
    every sequence's slots in order; row_start, row_len: int64 [T], where query row t's
    keys start in `slots` and how many it sees. Writes this split's partial result:
    out [T, Hq, splits, D] float32 (normalized within the split) and lse [T, Hq, splits]
    float32, natural log; a split with no key writes out 0 and lse -inf. F32_DOTS: the
    products in float32 (IEEE, not TF32) whatever the pools hold, else in the pools' dtype."""
    t = tl.program_id(0)
    hk = tl.program_id(1)
    s = tl.program_id(2)
    num_heads = tl.num_programs(1) * G
    splits = tl.num_programs(2)
    start = tl.load(row_start + t)
    lo = s * chunk
    hi = tl.minimum(lo + chunk, tl.load(row_len + t))
    g = tl.arange(0, G_PAD)  # the KV head's query heads, padded to a dot's smallest tile
    d = tl.arange(0, D_PAD)
    g_ok = g < G
    d_ok = d < D
    heads = hk * G + g
    # Products in the pools' dtype (or float32), summed in float32, as SDPA does.
    qd = tl.load(q + t * stride_qt + heads[:, None] * stride_qh + d[None, :],
                 mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [G_PAD, D_PAD]
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)  # running max of each head's scores
    l_i = tl.zeros([G_PAD], tl.float32)  # running sum of exp(score - m_i)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)  # running sum of exp(score - m_i) * v
    for j in range(lo, hi, BLOCK_N):
        offs = j + tl.arange(0, BLOCK_N)
        ok = offs < hi
        slot = tl.load(slots + start + offs, mask=ok, other=0).to(tl.int64)  # [BLOCK_N]
        rows = ok[:, None] & d_ok[None, :]
        # Masked keys are never read: a pool's unwritten slots may hold NaN bits.
        kb = tl.load(k_pool + slot[:, None] * stride_ks + hk * stride_kh + d[None, :], mask=rows, other=0.0)
        if F32_DOTS:
            sc = tl.dot(qd, tl.trans(kb.to(tl.float32)), input_precision="ieee")  # [G_PAD, BLOCK_N]
        else:
            sc = tl.dot(qd.to(kb.dtype), tl.trans(kb))
        sc = tl.where(ok[None, :], sc * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))  # finite: the block holds at least one key
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(sc - m_new[:, None])  # [G_PAD, BLOCK_N]
        vb = tl.load(v_pool + slot[:, None] * stride_vs + hk * stride_vh + d[None, :], mask=rows, other=0.0)
        if F32_DOTS:
            pv = tl.dot(p, vb.to(tl.float32), input_precision="ieee")  # [G_PAD, D_PAD]
        else:
            pv = tl.dot(p.to(vb.dtype), vb)
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    o = tl.where(seen[:, None], acc / l_safe[:, None], 0.0)
    part = tl.where(seen, m_i + tl.log(l_safe), float("-inf"))
    at = (t * num_heads + heads) * splits + s  # [G_PAD]
    tl.store(out + at[:, None] * D + d[None, :], o, mask=g_ok[:, None] & d_ok[None, :])
    tl.store(lse + at, part, mask=g_ok)
