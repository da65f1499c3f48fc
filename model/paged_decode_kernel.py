"""The Triton kernels of lamina.model.paged_decode: decode attention over a slab pool's
1-token pages (the attention workers) or over each sequence's own KV buffer (the local
engine), one program per (query row, KV head, split of the row's keys), and the engine's
write of a step's new K, V rows into those buffers.

Imported only where triton is installed (the GPU machines have it; the CPU install runs
it under Triton's interpreter in the tests). This module holds the kernels alone: their
launch and the split plan are lamina.model.paged_decode's; combine_splits joins the splits.
"""

import triton
import triton.language as tl


@triton.jit
def _attend_split(qd, kp, vp, slots, start, lo, hi, stride_ks, stride_vs, scale, d, d_ok,
                  G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
                  F32_DOTS: tl.constexpr):
    """One split of one row's keys [lo, hi) for a KV head's query heads qd [G_PAD, D_PAD]
    float32: key j is slot slots[start + j] (PAGED) or position j of kp, vp (rows of
    stride_ks / stride_vs elements). Returns (acc [G_PAD, D_PAD], l [G_PAD], m [G_PAD]):
    the sum of exp(score - m) * v, the sum of exp(score - m), the largest score."""
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for j in range(lo, hi, BLOCK_N):
        offs = j + tl.arange(0, BLOCK_N)
        ok = offs < hi
        if PAGED:
            slot = tl.load(slots + start + offs, mask=ok, other=0).to(tl.int64)  # [BLOCK_N]
        else:
            slot = offs.to(tl.int64)
        rows = ok[:, None] & d_ok[None, :]
        # Masked keys are never read: a pool's unwritten slots may hold NaN bits.
        kb = tl.load(kp + slot[:, None] * stride_ks + d[None, :], mask=rows, other=0.0)  # [BLOCK_N, D_PAD]
        # Products in the KV's dtype (or float32, IEEE, not TF32), summed in float32, as SDPA does.
        if F32_DOTS:
            sc = tl.dot(qd, tl.trans(kb.to(tl.float32)), input_precision="ieee")  # [G_PAD, BLOCK_N]
        else:
            sc = tl.dot(qd.to(kb.dtype), tl.trans(kb))
        sc = tl.where(ok[None, :], sc * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))  # finite: the block holds at least one key
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(sc - m_new[:, None])  # [G_PAD, BLOCK_N]
        vb = tl.load(vp + slot[:, None] * stride_vs + d[None, :], mask=rows, other=0.0)
        if F32_DOTS:
            pv = tl.dot(p, vb.to(tl.float32), input_precision="ieee")  # [G_PAD, D_PAD]
        else:
            pv = tl.dot(p.to(vb.dtype), vb)
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _store_split(out, lse, t, heads, num_heads, g_ok, d, d_ok, acc, l_i, m_i, D: tl.constexpr):
    """This program's partial result: out [T, Hq, splits, D] normalized within the split
    and lse [T, Hq, splits] (natural log); a split with no key writes 0 and -inf."""
    s = tl.program_id(2)
    splits = tl.num_programs(2)
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    o = tl.where(seen[:, None], acc / l_safe[:, None], 0.0)
    part = tl.where(seen, m_i + tl.log(l_safe), float("-inf"))
    at = (t * num_heads + heads) * splits + s  # [G_PAD]
    tl.store(out + at[:, None] * D + d[None, :], o, mask=g_ok[:, None] & d_ok[None, :])
    tl.store(lse + at, part, mask=g_ok)


@triton.jit
def _query(q, t, heads, g_ok, d, d_ok, stride_qt, stride_qh):
    return tl.load(q + t * stride_qt + heads[:, None] * stride_qh + d[None, :],
                   mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [G_PAD, D_PAD]


@triton.jit
def paged_decode(q, k_pool, v_pool, slots, row_start, row_len, out, lse,
                 stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
                 chunk, scale,
                 G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                 BLOCK_N: tl.constexpr, F32_DOTS: tl.constexpr):
    """q: [T, Hq, D]; k_pool, v_pool: [S, Hkv, D] (last dim contiguous); slots: int32,
    every sequence's slots in order; row_start, row_len: int64 [T], where query row t's
    keys start in `slots` and how many it sees. Writes each split's partial result (out,
    lse: _store_split). F32_DOTS: products in float32 whatever the pools hold."""
    t = tl.program_id(0)
    hk = tl.program_id(1)
    lo = tl.program_id(2) * chunk
    hi = tl.minimum(lo + chunk, tl.load(row_len + t))
    g = tl.arange(0, G_PAD)  # the KV head's query heads, padded to a dot's smallest tile
    d = tl.arange(0, D_PAD)
    g_ok, d_ok = g < G, d < D
    heads = hk * G + g
    qd = _query(q, t, heads, g_ok, d, d_ok, stride_qt, stride_qh)
    acc, l_i, m_i = _attend_split(qd, k_pool + hk * stride_kh, v_pool + hk * stride_vh, slots,
                                  tl.load(row_start + t), lo, hi, stride_ks, stride_vs, scale, d, d_ok,
                                  G_PAD, D_PAD, BLOCK_N, True, F32_DOTS)
    _store_split(out, lse, t, heads, tl.num_programs(1) * G, g_ok, d, d_ok, acc, l_i, m_i, D)


@triton.jit
def buffer_decode(q, row_base, row_cap, row_len, layer, out, lse, stride_qt, stride_qh, chunk, scale,
                  KV: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                  D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, F32_DOTS: tl.constexpr):
    """q: [T, Hq, D]; query row t reads the first row_len[t] positions of its sequence's
    buffer, [num_layers, 2, cap, HKV, D] contiguous of dtype KV, at address row_base[t]
    (int64) with cap row_cap[t]: K of `layer` at [layer, 0], V at [layer, 1]. Writes each
    split's partial result as paged_decode does."""
    t = tl.program_id(0)
    hk = tl.program_id(1)
    lo = tl.program_id(2) * chunk
    hi = tl.minimum(lo + chunk, tl.load(row_len + t))
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    g_ok, d_ok = g < G, d < D
    heads = hk * G + g
    qd = _query(q, t, heads, g_ok, d, d_ok, stride_qt, stride_qh)
    base = tl.load(row_base + t).to(tl.pointer_type(KV))
    plane = tl.load(row_cap + t) * (HKV * D)  # elements of one [cap, HKV, D] plane
    kp = base + (2 * layer) * plane + hk * D
    acc, l_i, m_i = _attend_split(qd, kp, kp + plane, row_base, 0, lo, hi, HKV * D, HKV * D, scale, d, d_ok,
                                  G_PAD, D_PAD, BLOCK_N, False, F32_DOTS)
    _store_split(out, lse, t, heads, tl.num_programs(1) * G, g_ok, d, d_ok, acc, l_i, m_i, D)


@triton.jit
def combine_splits(parts, part_lse, out, lse, splits, D: tl.constexpr, D_PAD: tl.constexpr,
                   S_BLOCK: tl.constexpr):
    """One program per (query row, query head), row-major: parts [T, Hq, splits, D]
    float32 (each split normalized within itself) and part_lse [T, Hq, splits] (natural
    log) combined by their log-sum-exp: out [T, Hq, D] (stored in its dtype) = the splits
    weighted by exp(part_lse - lse), lse [T, Hq] float32; where no split saw a key, out 0
    and lse -inf. One launch where torch's operators took eight. The splits are read
    S_BLOCK at a time, each lane keeping a running maximum, so that no split count
    compiles a variant of its own."""
    row = tl.program_id(0)
    s = tl.arange(0, S_BLOCK)
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    m_lane = tl.full([S_BLOCK], float("-inf"), tl.float32)
    total_lane = tl.zeros([S_BLOCK], tl.float32)
    acc = tl.zeros([S_BLOCK, D_PAD], tl.float32)
    for s0 in range(0, splits, S_BLOCK):
        ok = s0 + s < splits
        part = tl.load(part_lse + row * splits + s0 + s, mask=ok, other=float("-inf"))  # [S_BLOCK]
        p = tl.load(parts + (row * splits + s0 + s)[:, None] * D + d[None, :], mask=ok[:, None] & d_ok[None, :],
                    other=0.0)  # [S_BLOCK, D_PAD]
        m_new = tl.maximum(m_lane, part)
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # a lane that saw no key yet adds 0 below
        alpha = tl.exp(m_lane - m_safe)
        w = tl.exp(part - m_safe)
        acc = acc * alpha[:, None] + p * w[:, None]
        total_lane = total_lane * alpha + w
        m_lane = m_new
    m = tl.max(m_lane, 0)
    seen = m > float("-inf")
    m_safe = tl.where(seen, m, 0.0)
    scale = tl.exp(m_lane - m_safe)  # [S_BLOCK]
    total = tl.sum(total_lane * scale, 0)
    total_safe = tl.where(seen, total, 1.0)
    o = tl.sum(acc * scale[:, None], 0) / total_safe  # [D_PAD]
    tl.store(out + row * D + d, o, mask=d_ok)
    tl.store(lse + row, tl.where(seen, m_safe + tl.log(total_safe), float("-inf")))


@triton.jit
def buffer_append(k, v, row_base, row_cap, row_pos, layer, stride_kt, stride_vt,
                  KV: tl.constexpr, HKV: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr):
    """k, v: [T, HKV, D] (heads and dims contiguous): row t is written at position
    row_pos[t] of `layer` in its sequence's buffer (address row_base[t], cap row_cap[t],
    laid out as buffer_decode reads it), converted to KV. A row whose position is not
    below its cap writes nothing: a CUDA graph's padding rows (cap 0, address 0)."""
    t = tl.program_id(0)
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    cap = tl.load(row_cap + t)
    pos = tl.load(row_pos + t)
    inside = (h < HKV)[:, None] & (d < D)[None, :] & (pos < cap)
    cell = h[:, None] * D + d[None, :]  # [H_PAD, D_PAD]
    base = tl.load(row_base + t).to(tl.pointer_type(KV))
    plane = cap * (HKV * D)
    at = base + (2 * layer) * plane + pos * (HKV * D) + cell
    tl.store(at, tl.load(k + t * stride_kt + cell, mask=inside).to(KV), mask=inside)
    tl.store(at + plane, tl.load(v + t * stride_vt + cell, mask=inside).to(KV), mask=inside)


@triton.jit
def slab_append(k, v, k_pool, v_pool, row_slot, stride_kt, stride_vt, stride_ks, stride_vs,
                HKV: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr):
    """k, v: [T, HKV, D] (heads and dims contiguous): row t is written into slot
    row_slot[t] (int64) of the pools [S, HKV, D] (heads and dims contiguous, rows of
    stride_ks / stride_vs elements), converted to the pools' dtype. A row whose slot is
    negative writes nothing: a CUDA graph's padding rows."""
    t = tl.program_id(0)
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    slot = tl.load(row_slot + t)
    inside = (h < HKV)[:, None] & (d < D)[None, :] & (slot >= 0)
    cell = h[:, None] * D + d[None, :]  # [H_PAD, D_PAD]
    kv_k = tl.load(k + t * stride_kt + cell, mask=inside)
    tl.store(k_pool + slot * stride_ks + cell, kv_k.to(k_pool.dtype.element_ty), mask=inside)
    kv_v = tl.load(v + t * stride_vt + cell, mask=inside)
    tl.store(v_pool + slot * stride_vs + cell, kv_v.to(v_pool.dtype.element_ty), mask=inside)
