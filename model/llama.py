"""A plain LLaMA-family decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Parameter names follow Hugging Face's, so a checkpoint's state dict loads as is.
Activations are token-major with no batch dimension: the tokens of every
sequence in a batch are concatenated ([T, ...]), and the attention context
knows where each sequence starts. Attention is the only operator with state;
it is injected (`AttentionContext`), so the rest of the model is pure and can
be cut into slices at its `AttentionOp`s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.attention import AttentionContext
from model.config import ModelConfig
from model.rope import apply_rope, inverse_frequencies, rope_cos_sin
from model.splitter import SplitModel


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, d]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class AttentionOp(nn.Module):
    """The attention operator of one layer: holds no weights, delegates to the context.

    The splitter cuts the model at these modules; a served model never calls
    them, it ships their inputs (Q, K, V) to attention workers instead.
    """

    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:  # q: [T, Hq, D], k, v: [T, Hkv, D] -> [T, Hq, D]
        return ctx.attend(self.layer_id, q, k, v)


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.q_size, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.attn = AttentionOp(layer_id)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:  # x: [T, d]
        q = self.q_proj(x).view(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        o = self.attn(q, k, v, ctx)  # [T, Hq, D]
        return self.o_proj(o.reshape(-1, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, d]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:  # x: [T, d] residual stream
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        inv_freq = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [D/2]


class LlamaForCausalLM(nn.Module):
    """Decoder plus LM head. forward returns logits only where they are sampled."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_index: torch.Tensor,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64; logits_index: [B] rows of T to score.

        Returns logits [B, vocab] float32.
        """
        cos, sin = rope_cos_sin(positions, self.model.inv_freq)  # [T, 1, D]
        x = self.model.embed_tokens(input_ids)  # [T, d]
        for layer in self.model.layers:
            x = layer(x, cos, sin, ctx)
        x = self.model.norm(x[logits_index])  # [B, d]
        return self.lm_head(x).float()  # [B, V]


def is_attention_op(module: nn.Module) -> bool:
    return isinstance(module, AttentionOp)


def split_llama(model: LlamaForCausalLM, example_tokens: int = 8) -> SplitModel:
    """Split at every layer's attention. Slices take input_ids, positions, logits_index."""
    from model.splitter import split_model
    from model.attention import attention_with_lse

    class _Dense:
        def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return attention_with_lse(q, k, v)[0]

    example = {
        "input_ids": torch.zeros(example_tokens, dtype=torch.long),
        "positions": torch.arange(example_tokens),
        "logits_index": torch.tensor([example_tokens - 1]),
        "ctx": _Dense(),
    }
    with torch.no_grad():
        return split_model(model, example, is_attention_op)
