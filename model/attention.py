"""The attention operator, over token-granular KV with no padding.

Every function returns the output together with its softmax statistic, the
log-sum-exp of the scaled scores (lse = m + log S with m the row maximum and
S = sum exp(s - m)). Two results over disjoint key sets I1, I2 then combine
exactly into the result over I1 u I2:

    A(I) = (A(I1) S(I1) + A(I2) S(I2)) / (S(I1) + S(I2)),   S(Ij) = exp(lse_j)

which is what lets attention be split over workers by request, by head, or by
token range (old tokens on the attention worker, the new token beside it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F  # noqa: N812 (torch's conventional name)


class AttentionContext(Protocol):
    """What the model's attention operators call. Implementations own the KV.

    q: [T, Hq, D] and k, v: [T, Hkv, D] hold the new tokens of every sequence in
    the batch, concatenated in batch order (token-major, no padding); the
    context knows the sequences' boundaries and histories. Returns [T, Hq, D].
    """

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one sequence's n newest tokens over all of its L keys.

    q: [n, Hq, D]; k, v: [L, Hkv, D] with L >= n, the last n keys being the
    queries' own tokens. With `causal`, query i sees keys 0 .. L-n+i.
    Returns out [n, Hq, D] and lse [n, Hq] (float32).
    """
    n, num_heads, head_dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    groups = num_heads // num_kv_heads
    scale = head_dim**-0.5
    # Group query heads by the KV head they share: [Hkv, n*G, D], row r is token r // G.
    qg = q.view(n, num_kv_heads, groups, head_dim).permute(1, 0, 2, 3).reshape(num_kv_heads, n * groups, head_dim)
    # Softmax in at least float32, whatever the KV dtype.
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(qg, k.permute(1, 2, 0)).to(acc) * scale  # [Hkv, n*G, L]
    if causal and n > 1:
        query_pos = torch.arange(n, device=q.device).repeat_interleave(groups) + (num_keys - n)  # [n*G]
        key_pos = torch.arange(num_keys, device=q.device)  # [L]
        scores.masked_fill_(key_pos[None, None, :] > query_pos[None, :, None], float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)  # [Hkv, n*G, 1]
    probs = torch.exp(scores - row_max)
    row_sum = probs.sum(dim=-1, keepdim=True)  # [Hkv, n*G, 1]
    out = torch.matmul((probs / row_sum).to(v.dtype), v.permute(1, 0, 2))  # [Hkv, n*G, D]
    lse = (row_max + row_sum.log()).squeeze(-1)  # [Hkv, n*G]
    out = out.view(num_kv_heads, n, groups, head_dim).permute(1, 0, 2, 3).reshape(n, num_heads, head_dim)
    lse = lse.view(num_kv_heads, n, groups).permute(1, 0, 2).reshape(n, num_heads)
    return out, lse


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`attention_with_lse(q, k, v)[0]` through torch's fused SDPA kernel, without lse.

    For callers that need no partials to combine (the local engine): one kernel
    call instead of a dozen small ops, about 3x faster per sequence and layer on
    CPU at decode; on the CPU, queries after a prefix take two (`_after_prefix`).
    q: [n, Hq, D]; k, v: [L, Hkv, D], L >= n. Returns [n, Hq, D].
    """
    n, num_heads, _ = q.shape
    num_keys, num_kv_heads, _ = k.shape
    if 1 < n < num_keys and q.device.type == "cpu":
        return _after_prefix(q, k, v)
    mask = None
    if n > 1 and n != num_keys:
        # Query i sees keys 0 .. L-n+i (SDPA's is_causal aligns to the top left instead).
        mask = torch.arange(num_keys, device=q.device) <= (torch.arange(n, device=q.device)[:, None] + num_keys - n)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],  # [1, H, n|L, D]
        attn_mask=mask, is_causal=n > 1 and n == num_keys, enable_gqa=num_heads != num_kv_heads,
    )  # [1, Hq, n, D]
    return out[0].transpose(0, 1)


def _after_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`causal_attention` of n > 1 queries after a prefix of L - n keys, on the CPU (a
    prompt's chunk, or the rest of a prompt whose prefix was cached): the prefix unmasked
    and the queries' own keys causal, two calls of torch's CPU flash kernel, combined by
    their log-sum-exp. SDPA's causal mask aligns top left, so one call needs an explicit
    mask, which computes the masked half of the queries' own block and runs slower per
    key (the prefill of 2,048 tokens in chunks of 512 took a third more attention time
    than in one forward); the public SDPA returns no log-sum-exp, hence the kernel's op.
    q: [n, Hq, D]; k, v: [L, Hkv, D]. Returns [n, Hq, D]."""
    n, num_heads, _ = q.shape
    num_keys, num_kv_heads, _ = k.shape
    prefix = num_keys - n
    # [1, H, n|L, D], K and V repeated per query head (the kernel takes no GQA).
    qh = q.transpose(0, 1)[None]
    kh = k.transpose(0, 1).repeat_interleave(num_heads // num_kv_heads, 0)[None]
    vh = v.transpose(0, 1).repeat_interleave(num_heads // num_kv_heads, 0)[None]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out_a, lse_a = flash(qh, kh[:, :, :prefix], vh[:, :, :prefix])[:2]  # [1, Hq, n, D], [1, Hq, n]
    out_b, lse_b = flash(qh, kh[:, :, prefix:], vh[:, :, prefix:], is_causal=True)[:2]
    out, _ = combine_partials(out_a[0].transpose(0, 1), lse_a[0].transpose(0, 1),
                              out_b[0].transpose(0, 1), lse_b[0].transpose(0, 1))
    return out  # [n, Hq, D]


def batched_attention(
    q: torch.Tensor,
    query_lens: Sequence[int],
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention for a batch of sequences of different lengths, no padding.

    q: [sum(query_lens), Hq, D], sequences concatenated in order; keys[b], values[b]:
    [L_b, Hkv, D], each sequence's whole KV including its new tokens. Decode is the
    case query_lens == [1] * B; prefill (with or without a cached prefix) is causal.
    Returns out [sum(query_lens), Hq, D] and lse [sum(query_lens), Hq].
    """
    outs: list[torch.Tensor] = []
    lses: list[torch.Tensor] = []
    start = 0
    for n, k, v in zip(query_lens, keys, values):
        out, lse = attention_with_lse(q[start : start + n], k, v, causal=True)
        outs.append(out)
        lses.append(lse)
        start += n
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs), torch.cat(lses)


def combine_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets. out: [..., H, D]; lse: [..., H]."""
    lse = torch.logaddexp(lse_a, lse_b)  # [..., H]
    weight_a = torch.exp(lse_a - lse)[..., None]
    weight_b = torch.exp(lse_b - lse)[..., None]
    acc = torch.promote_types(out_a.dtype, torch.float32)
    out = out_a.to(acc) * weight_a + out_b.to(acc) * weight_b
    return out.to(out_a.dtype), lse
