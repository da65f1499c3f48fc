"""A plain LLaMA-family decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Parameter names follow Hugging Face's, except that each layer's Q, K and V
projections are one linear (`qkv_proj`) and so are the MLP's gate and up
projections (`gate_up_proj`): one product each instead of three and two. A
Hugging Face state dict still loads as is: the fused weights are concatenated
from the checkpoint's tensors as it loads (`FUSED_PROJECTIONS`).

Activations are token-major with no batch dimension: the tokens of every
sequence in a batch are concatenated ([T, ...]), and the attention context
knows where each sequence starts. Attention is the only operator with state;
it is injected (`AttentionContext`), so the rest of the model is pure and can
be cut into slices at its `AttentionOp`s.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.fx
import torch.nn.functional as F  # noqa: N812 (torch's conventional name)
from torch import nn

from lamina.model.attention import AttentionContext
from lamina.model.config import ModelConfig
from lamina.model.quant import QuantEmbedding, QuantLinear
from lamina.model.rope import apply_rope, inverse_frequencies, rope_cos_sin, with_rope_table
from lamina.model.splitter import SplitModel

try:
    import lamina.model._slice_ops as _SLICE_OPS  # noqa: N812 (a module constant: the native kernel, or None)
except ImportError:  # not built (no C compiler at install): torch's rms_norm runs
    _SLICE_OPS = None


# Fused projections -> the checkpoint tensors they concatenate, rows in this order.
FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _fuse_checkpoint_tensors(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook: checkpoint names -> fused tensors (left alone when a part is missing)."""
    for fused, parts in FUSED_PROJECTIONS.items():
        if not hasattr(module, fused):
            continue
        for kind in ("weight", "bias"):
            keys = [f"{prefix}{part}.{kind}" for part in parts]
            if all(k in state_dict for k in keys):
                state_dict[f"{prefix}{fused}.{kind}"] = torch.cat([state_dict.pop(k) for k in keys])


def checkpoint_names(names: Iterable[str]) -> set[str]:
    """Parameter names as a Hugging Face checkpoint spells them (fused ones split)."""
    out: set[str] = set()
    for name in names:
        module, _, kind = name.rpartition(".")
        path, _, last = module.rpartition(".")
        parts = FUSED_PROJECTIONS.get(last)
        if parts:
            out.update(f"{path}.{p}.{kind}" for p in parts)
        else:
            out.add(name)
    return out


def _native_rows(t: torch.Tensor) -> bool:
    """Whether the native operators take t: built, CPU float32 [T, d] with rows of adjacent values."""
    return _SLICE_OPS is not None and t.dtype == torch.float32 and t.is_cpu and t.dim() == 2 and t.stride(1) == 1


def _native_weight(w: torch.Tensor) -> bool:
    """Whether a norm's weight is what the native operators read: CPU float32, contiguous."""
    return w.dtype == torch.float32 and w.is_cpu and w.is_contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)) over the last dimension; x: [T, d].

    One native call (csrc/slice_ops.c) for float32 rows, else torch's rms_norm, which
    computes Hugging Face's form with its rounding. A leaf for torch.fx (wrapped below).
    """
    if not (_native_rows(x) and _native_weight(weight)):
        return F.rms_norm(x, weight.shape, weight, eps)
    out = x.new_empty(x.shape)  # [T, d] (new_empty: a third of torch.empty's cost with a dtype argument)
    _SLICE_OPS.rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
    return out


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm: (x + h, rms_norm(x + h)); x, h: [T, d].

    h is consumed: the native path (float32 rows, h contiguous; the same rounding as the
    add, then `rms_norm`) writes the sum over h, a sublayer's fresh output read by
    nothing else, instead of allocating it.
    """
    if not (_native_rows(x) and _native_rows(h) and h.is_contiguous() and x.shape == h.shape
            and _native_weight(weight)):
        total = x + h
        return total, rms_norm(total, weight, eps)
    out = torch.empty_like(h)  # [T, d]
    _SLICE_OPS.add_rms_norm(x.data_ptr(), x.stride(0), h.data_ptr(), weight.data_ptr(), out.data_ptr(), h.shape[0],
                            h.shape[1], eps)
    return h, out


def rotary(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] (heads of one token adjacent, rows may be wider: Q's and K's heads of
    the fused projection); positions: [T] int64. Returns x rotated, [T, H, D].

    For float32 on the CPU one native call reading cos and sin from `rope_table` (equal to
    `apply_rope(x, *rope_cos_sin(positions, inv_freq))` bit for bit) that rotates x in
    place (the projection's fresh output) and returns it; else those two, into a new tensor.
    """
    t, heads, d = x.shape
    native = (_SLICE_OPS is not None and x.dtype == torch.float32 and x.is_cpu and x.stride(2) == 1
              and x.stride(1) == d and positions.dtype == torch.int64 and positions.is_cpu
              and positions.is_contiguous() and positions.shape == (t,) and inv_freq.is_cpu)
    if not native:
        return apply_rope(x, *rope_cos_sin(positions, inv_freq))
    with_rope_table(inv_freq, positions, lambda cos, sin: _SLICE_OPS.rope(  # checks every position before rotating
        x.data_ptr(), x.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[0], t, heads, d))
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The gated MLP's activation: silu(gate) * up; gate_up: [T, 2F] (gate, then up) -> [T, F]."""
    if not _native_rows(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)  # [T, F] each (views)
        return F.silu(gate) * up
    f = gate_up.shape[1] // 2
    out = gate_up.new_empty((gate_up.shape[0], f))  # [T, F]
    _SLICE_OPS.silu_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), gate_up.shape[0], f)
    return out


# Leaves for torch.fx: each is one node of a traced slice, called as it is.
for _leaf in ("rms_norm", "add_rms_norm", "rotary", "silu_mul"):
    torch.fx.wrap(_leaf)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, d]
        return rms_norm(x, self.weight, self.eps)

    def after_add(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + h, this norm of it): the residual add before the norm, in one operator."""
        return add_rms_norm(x, h, self.weight, self.eps)


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
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.attn = AttentionOp(layer_id)
        self.register_load_state_dict_pre_hook(_fuse_checkpoint_tensors)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:  # x: [T, d]; positions: [T]
        hq, hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(-1, hq + 2 * hkv, self.head_dim)  # [T, Hq + 2 Hkv, D]
        qk = rotary(qkv[:, : hq + hkv], positions, inv_freq)  # [T, Hq + Hkv, D]: Q and K rotated at once
        q, k = qk[:, :hq], qk[:, hq:]  # [T, Hq, D], [T, Hkv, D] (views)
        v = qkv[:, hq + hkv :]  # [T, Hkv, D] (a view)
        o = self.attn(q, k, v, ctx)  # [T, Hq, D]
        return self.o_proj(o.reshape(-1, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.register_load_state_dict_pre_hook(_fuse_checkpoint_tensors)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, d]
        return self.down_proj(silu_mul(self.gate_up_proj(x)))  # gate_up: [T, 2F] -> [T, F] -> [T, d]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, inv_freq: torch.Tensor,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [T, d], the previous layer's MLP output not yet added to the residual stream
        (the embeddings, with residual None, for the first layer); residual: [T, d].
        Returns this layer's (MLP output, residual stream before it): each add is fused
        with the norm after it, as the sums equal the plain layer's (x + a, then + m)."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            residual, x = self.input_layernorm.after_add(residual, h)
        residual, x = self.post_attention_layernorm.after_add(residual, self.self_attn(x, positions, inv_freq, ctx))
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    inv_freq: torch.Tensor  # a buffer, registered in __init__: [D/2]

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # nn.Embedding's own init, but not on the meta device the loader builds on: a
        # meta tensor's normal_ imports torch._dynamo (seconds of every worker's start) for
        # values the checkpoint overwrites anyway.
        embedding = torch.empty(cfg.vocab_size, cfg.hidden_size)  # [V, H]
        if not embedding.is_meta:
            nn.init.normal_(embedding)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=embedding)
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
        h, residual = self.model.embed_tokens(input_ids), None  # [T, d]
        for layer in self.model.layers:
            h, residual = layer(h, residual, positions, self.model.inv_freq, ctx)
        x = (residual + h)[logits_index] if residual is not None else h[logits_index]  # [B, d]
        x = self.model.norm(x)
        return self.lm_head(x).float()  # [B, V]


def is_attention_op(module: nn.Module) -> bool:
    return isinstance(module, AttentionOp)


def is_packed_module(module: nn.Module) -> bool:
    """Linears and embeddings over packed weights: called whole by the slices, never traced."""
    return isinstance(module, (QuantLinear, QuantEmbedding))


def split_llama(model: LlamaForCausalLM, example_tokens: int = 8) -> SplitModel:
    """Split at every layer's attention. Slices take input_ids, positions, logits_index."""
    from lamina.model import fused_slice
    from lamina.model.attention import attention_with_lse
    from lamina.model.splitter import split_model

    class _Dense:
        def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return attention_with_lse(q, k, v)[0]

    # The example runs through the model (shape propagation): on its device, which is not
    # the CPU where an engine before this one placed the same model elsewhere.
    device = next(model.parameters()).device
    example = {
        "input_ids": torch.zeros(example_tokens, dtype=torch.long, device=device),
        "positions": torch.arange(example_tokens, device=device),
        "logits_index": torch.tensor([example_tokens - 1], device=device),
        "ctx": _Dense(),
    }
    with torch.no_grad():
        split = split_model(model, example, is_attention_op, is_packed_module)
    fused_slice.attach(model, split)
    return split
