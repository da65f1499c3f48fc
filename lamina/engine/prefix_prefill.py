"""Prefill that starts from cached prefix KV, one sequence on the whole model: the glue
between a PrefixCache and the model that bench/prefix_cache.py and the KV store's tests
run (the prefill workers batch their prompts over the split model instead:
services/prefill/prefill_service.py).

The model's attention operators call an AttentionContext (lamina.model.attention); this one
holds one sequence's KV as [num_layers, 2, T, n_kv_heads, head_dim], with the cached
prefix already in its first P positions, so only tokens P..T-1 run through the model.
The KV it returns is exactly what `PrefixCache.insert` takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lamina.model.attention import attention_with_lse
from lamina.model.llama import LlamaForCausalLM


class _SequenceContext:
    """One sequence's KV, growing in place; positions [0, length) are filled."""

    def __init__(self, model: LlamaForCausalLM, capacity: int,
                 prefix_kv: torch.Tensor | None) -> None:
        cfg = model.config
        # The final norm's weight is a plain parameter whatever form the linears' weights take.
        dtype = model.model.norm.weight.dtype
        device = model.model.norm.weight.device
        self.kv = torch.empty(cfg.num_layers, 2, capacity, cfg.num_kv_heads, cfg.head_dim,
                              dtype=dtype, device=device)  # [L, 2, capacity, H, D]
        self.length = 0
        if prefix_kv is not None:
            self.length = prefix_kv.shape[2]
            self.kv[:, :, :self.length] = prefix_kv
        self._num_new = 0

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        # q: [n, Hq, D]; k, v: [n, Hkv, D] of the new tokens
        n = k.shape[0]
        end = self.length + n
        self.kv[layer_id, 0, self.length:end] = k
        self.kv[layer_id, 1, self.length:end] = v
        self._num_new = n
        out, _ = attention_with_lse(q, self.kv[layer_id, 0, :end], self.kv[layer_id, 1, :end])
        return out  # [n, Hq, D]

    def commit(self) -> None:
        self.length += self._num_new
        self._num_new = 0


def _forward(model: LlamaForCausalLM, ctx: _SequenceContext, tokens: Sequence[int]) -> torch.Tensor:
    device = model.model.norm.weight.device
    ids = torch.tensor(list(tokens), dtype=torch.long, device=device)  # [n]
    positions = torch.arange(ctx.length, ctx.length + len(tokens), device=device)  # [n]
    last = torch.tensor([len(tokens) - 1], device=device)  # [1]
    with torch.inference_mode():
        logits = model(ids, positions, last, ctx)  # [1, V]
    ctx.commit()
    return logits[0]


@dataclass(frozen=True)
class PrefillResult:
    logits: torch.Tensor  # [V] float32, of the prompt's last token
    kv: torch.Tensor  # [L, 2, T, H, D], the whole prompt's KV
    num_cached_tokens: int  # tokens taken from the prefix KV (not computed)
    generated: tuple[int, ...] = ()  # greedy continuation, when asked for


def prefill(model: LlamaForCausalLM, tokens: Sequence[int],
            prefix_kv: torch.Tensor | None = None, max_new_tokens: int = 0,
            eos_token_ids: Sequence[int] = ()) -> PrefillResult:
    """Runs the prompt's uncached suffix (prefix_kv: [L, 2, P, H, D] of its first P
    tokens, P < len(tokens)), then greedy-decodes `max_new_tokens` tokens."""
    if not tokens:
        raise ValueError("empty prompt")
    num_cached = 0 if prefix_kv is None else prefix_kv.shape[2]
    if num_cached >= len(tokens):
        # The last prompt token must run: its logits pick the first new token.
        num_cached = len(tokens) - 1
        prefix_kv = prefix_kv[:, :, :num_cached] if prefix_kv is not None and num_cached else None
    ctx = _SequenceContext(model, len(tokens) + max_new_tokens, prefix_kv)
    logits = _forward(model, ctx, tokens[num_cached:])
    kv = ctx.kv[:, :, :len(tokens)].clone()
    generated: list[int] = []
    step_logits = logits
    for _ in range(max_new_tokens):
        token = int(step_logits.argmax())
        generated.append(token)
        if token in eos_token_ids:
            break
        step_logits = _forward(model, ctx, [token])
    return PrefillResult(logits, kv, num_cached, tuple(generated))
