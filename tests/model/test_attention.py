import torch

from lamina.model.attention import attention_with_lse, batched_attention, combine_partials


def _sdpa(q, k, v, causal):
    # q: [n, Hq, D], k/v: [m, Hkv, D] -> reference via torch SDPA with GQA expansion
    groups = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(groups, dim=1).transpose(0, 1)
    vv = v.repeat_interleave(groups, dim=1).transpose(0, 1)
    n, m = q.shape[0], k.shape[0]
    mask = None
    if causal:
        mask = torch.arange(m)[None, :] <= (torch.arange(n)[:, None] + m - n)
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask)
    return out.transpose(0, 1)


def test_prefill_and_decode_match_sdpa():
    torch.manual_seed(0)
    for n, m in [(1, 1), (1, 37), (5, 5), (4, 20)]:
        q = torch.randn(n, 9, 64, dtype=torch.float64)
        k = torch.randn(m, 3, 64, dtype=torch.float64)
        v = torch.randn(m, 3, 64, dtype=torch.float64)
        out, lse = attention_with_lse(q, k, v)
        torch.testing.assert_close(out, _sdpa(q, k, v, causal=True), rtol=1e-10, atol=1e-10)
        assert lse.shape == (n, 9)


def test_partials_over_disjoint_tokens_combine_exactly():
    torch.manual_seed(1)
    q = torch.randn(1, 9, 64, dtype=torch.float64)
    k = torch.randn(50, 3, 64, dtype=torch.float64)
    v = torch.randn(50, 3, 64, dtype=torch.float64)
    full, full_lse = attention_with_lse(q, k, v)
    # Old tokens on one side, the rest on another (any disjoint split works).
    a, lse_a = attention_with_lse(q, k[:31], v[:31], causal=False)
    b, lse_b = attention_with_lse(q, k[31:], v[31:], causal=False)
    out, lse = combine_partials(a, lse_a, b, lse_b)
    torch.testing.assert_close(out, full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, full_lse, rtol=1e-12, atol=1e-12)
    # The formula of the issue: A(I) = (A1 S1 + A2 S2) / (S1 + S2), S = exp(lse).
    s1, s2 = lse_a.exp()[..., None], lse_b.exp()[..., None]
    torch.testing.assert_close((a * s1 + b * s2) / (s1 + s2), full, rtol=1e-12, atol=1e-12)


def test_request_and_head_partitions_recombine():
    torch.manual_seed(2)
    lens = [3, 17, 1, 40]
    q = torch.randn(len(lens), 9, 64)
    keys = [torch.randn(n, 3, 64) for n in lens]
    values = [torch.randn(n, 3, 64) for n in lens]
    full, _ = batched_attention(q, [1] * 4, keys, values)
    # Request-level: two workers each take two requests.
    a, _ = batched_attention(q[:2], [1, 1], keys[:2], values[:2])
    b, _ = batched_attention(q[2:], [1, 1], keys[2:], values[2:])
    assert torch.equal(torch.cat([a, b]), full)
    # Head-level: KV head 0 (query heads 0-2) on one worker, KV heads 1-2 on another.
    h0, _ = batched_attention(q[:, :3], [1] * 4, [k[:, :1] for k in keys], [v[:, :1] for v in values])
    h1, _ = batched_attention(q[:, 3:], [1] * 4, [k[:, 1:] for k in keys], [v[:, 1:] for v in values])
    torch.testing.assert_close(torch.cat([h0, h1], dim=1), full, rtol=0, atol=1e-6)


def test_mixed_prefill_and_decode_batch():
    torch.manual_seed(3)
    qlens, klens = [4, 1, 2], [4, 9, 7]
    q = torch.randn(sum(qlens), 9, 64, dtype=torch.float64)
    keys = [torch.randn(n, 3, 64, dtype=torch.float64) for n in klens]
    values = [torch.randn(n, 3, 64, dtype=torch.float64) for n in klens]
    out, _ = batched_attention(q, qlens, keys, values)
    start = 0
    for n, k, v in zip(qlens, keys, values):
        torch.testing.assert_close(out[start : start + n], _sdpa(q[start : start + n], k, v, True))
        start += n


def test_fused_causal_attention_equals_the_reference_path():
    from lamina.model.attention import causal_attention

    torch.manual_seed(4)
    # Queries after a prefix (3 of 11 keys, 5 of 6, 40 of 300) take the CPU's split path.
    for n, m in [(1, 1), (1, 33), (6, 6), (3, 11), (5, 6), (40, 300)]:
        q = torch.randn(n, 9, 64, dtype=torch.float64)
        k = torch.randn(m, 3, 64, dtype=torch.float64)
        v = torch.randn(m, 3, 64, dtype=torch.float64)
        torch.testing.assert_close(causal_attention(q, k, v), attention_with_lse(q, k, v)[0],
                                   rtol=1e-12, atol=1e-12)
        low = causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16())  # the prefill's bfloat16 on a CPU
        assert low.dtype == torch.bfloat16
        torch.testing.assert_close(low.double(), attention_with_lse(q, k, v)[0], rtol=0.02, atol=0.02)
