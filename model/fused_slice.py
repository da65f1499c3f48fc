"""A LLaMA model's middle slices, each run as one native call on decode-sized steps.

Slice j (0 < j < layers) of `split_llama` is layer j - 1's second half and layer j's
first: the output projection, the residual add and post-attention norm, the gated MLP,
the next add and input norm, the QKV projection and RoPE. Its traced code makes a dozen
Python-level calls (each product's checks and output tensor, each small operator's), about
50 us a layer at batch 1 on one core, which is 1.5 ms of a 30-layer step of SmolLM2 whose
products take 6-10. `FusedSlice` runs the same operators in csrc/slice_ops.c's `layer`:
the same functions on the same rows in the same order (so the same bits; tested against
the traced slice), intermediates in the native side's scratch. Its two outputs (Q, K, V
and the residual stream) are new tensors a call, or, where the step's inputs carry
`REUSE_OUTPUTS` (`SplitModel.run(..., reuse_outputs=True)`: a whole step in one call
whose attention copies K and V away), the slice's own, kept from the last step with as
many tokens (at most `REUSED_MAX_TOKENS`) with their Q, K, V: views at one token, rows
copied into contiguous tensors of their own at more (what the attention kernels read, so
they copy nothing): a decode step then makes no tensor in the middle slices or for the
attention's inputs.

It takes a step of at most `FUSED_MAX_TOKENS` tokens on CPU float32 tensors and packed
linears; anything else (a long prompt, a model placed on a GPU, a native part not built)
returns None and the slice's traced code runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lamina.model import quant
from lamina.model.quant import QuantLinear
from lamina.model.rope import with_rope_table
from lamina.model.splitter import REUSE_OUTPUTS, SliceOutput, SplitModel

try:
    import lamina.model._slice_ops as _SLICE_OPS  # noqa: N812 (a module constant: the native kernel, or None)
except ImportError:  # not built: the traced slices run
    _SLICE_OPS = None
NATIVE: Any = _SLICE_OPS if _SLICE_OPS is not None and quant.NATIVE is not None else None
if NATIVE is not None:
    NATIVE.use_products(quant.NATIVE.products())

# Steps up to this many tokens run fused (decode steps, short prompts' chunks); the
# scratch they need is (2 d + 3 F) floats a token, about 20 KB for SmolLM2. Longer steps
# spend their time in the products, where a dozen Python calls do not matter.
FUSED_MAX_TOKENS = 256
# The most tokens a step may have for the slices to keep its outputs (REUSE_OUTPUTS):
# decode batches; the outputs of one [64 tokens] step are 0.6 MB a layer for SmolLM2.
REUSED_MAX_TOKENS = 64


class FusedSlice:
    """Slice j of a LLaMA model in one native call: (positions, layer j - 1's attention
    output, the residual stream) -> (layer j's Q, K, V, the residual stream after layer j - 1)."""

    def __init__(self, model: Any, j: int) -> None:
        cfg = model.config
        before, after = model.model.layers[j - 1], model.model.layers[j]
        self._linears: tuple[QuantLinear, ...] = _linears(model, j)
        self._norms = (before.post_attention_layernorm, after.input_layernorm)
        self._inv_freq = model.model.inv_freq
        self._eps = before.post_attention_layernorm.eps
        self._heads, self._kv_heads, self._head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self._d, self._f = cfg.hidden_size, cfg.intermediate_size
        self._q_size = cfg.num_heads * cfg.head_dim
        self._key: tuple | None = None  # the addresses the plan was made from
        self._plan: Any = None  # the native plan, or None where the weights are not what it reads
        # Outputs kept for steps of as many tokens as they have rows: (qkv, out, (q, k, v)).
        self._kept: tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    def _current_plan(self) -> Any:
        """The native plan of the weights as they are now (remade when an address moved)."""
        o, gu, down, qkv = self._linears
        post, nxt = self._norms[0].weight, self._norms[1].weight
        key = (o.native_args(), gu.native_args(), down.native_args(), qkv.native_args(), post.data_ptr(),
               nxt.data_ptr())
        if key != self._key:
            self._key, self._plan = key, None
            tensors = [t for m in self._linears for t in m.buffers()] + [post, nxt]
            if all(t.is_cpu for t in tensors) and all(w.dtype == torch.float32 and w.is_contiguous()
                                                        for w in (post, nxt)):
                self._plan = NATIVE.plan(*key[:4], key[4], key[5], self._eps, self._d, self._f, self._heads,
                                         self._kv_heads, self._head_dim)
        return self._plan

    def __call__(self, inputs: dict[str, Any], attn_out: torch.Tensor | None,
                 context: Sequence[torch.Tensor]) -> SliceOutput | None:
        positions = inputs["positions"]  # [T] int64
        residual = context[0]  # [T, d]
        t = residual.shape[0]
        if not (t <= FUSED_MAX_TOKENS and attn_out is not None and _rows(residual, self._d)
                and attn_out.dtype == torch.float32 and _dense(attn_out) and attn_out.numel() == t * self._q_size
                and _dense(positions) and positions.dtype == torch.int64 and positions.shape == (t,)):
            return None
        plan = self._current_plan()
        if plan is None:
            return None
        kept = inputs.get(REUSE_OUTPUTS) and t <= REUSED_MAX_TOKENS
        if kept:
            if self._kept is None or self._kept[1].shape[0] != t:
                self._kept = self._outputs(residual, t, separate=t > 1)
            qkv, out, heads = self._kept
        else:
            qkv, out, heads = self._outputs(residual, t)
        with_rope_table(self._inv_freq, positions, lambda cos, sin: NATIVE.layer(  # checks every position first
            plan, attn_out.data_ptr(), residual.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            cos.shape[0], qkv.data_ptr(), out.data_ptr(), t, quant.kernel_threads()))
        if kept and t > 1:  # Q, K, V rows into their own kept tensors, which the attention takes as they are
            for dst, src in zip(heads, self._heads_of(qkv, t), strict=True):
                dst.copy_(src)
        return SliceOutput(heads, [out], None)

    def _heads_of(self, qkv: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q [T, Hq, D], K and V [T, Hkv, D] as views of QKV [T, (Hq + 2 Hkv) D] (strided where T > 1)."""
        h, hkv = self._heads, self._kv_heads
        rows = qkv.view(t, h + 2 * hkv, self._head_dim)  # [T, Hq + 2 Hkv, D]
        return rows[:, :h], rows[:, h:h + hkv], rows[:, h + hkv:]

    def _outputs(self, residual: torch.Tensor, t: int, separate: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """New outputs for a step of t tokens: QKV [T, (Hq + 2 Hkv) D], the residual stream
        [T, d], and Q [T, Hq, D], K and V [T, Hkv, D]: views of QKV (`_heads_of`), or with
        `separate` contiguous tensors of their own."""
        h, hkv, dim = self._heads, self._kv_heads, self._head_dim
        qkv = residual.new_empty((t, (h + 2 * hkv) * dim))
        heads = ((residual.new_empty((t, h, dim)), residual.new_empty((t, hkv, dim)), residual.new_empty((t, hkv, dim)))
                 if separate else self._heads_of(qkv, t))
        return qkv, residual.new_empty((t, self._d)), heads


def _linears(model: Any, j: int) -> tuple[Any, ...]:
    """Slice j's products in order: layer j - 1's output projection, gate/up and down,
    layer j's QKV projection."""
    before, after = model.model.layers[j - 1], model.model.layers[j]
    return before.self_attn.o_proj, before.mlp.gate_up_proj, before.mlp.down_proj, after.self_attn.qkv_proj


def _dense(t: torch.Tensor) -> bool:
    return t.is_cpu and t.is_contiguous()


def _rows(t: torch.Tensor, d: int) -> bool:
    """Whether t is a contiguous CPU float32 [T, d] tensor."""
    return t.dtype == torch.float32 and t.is_cpu and t.is_contiguous() and t.dim() == 2 and t.shape[1] == d


def attach(model: Any, split: SplitModel) -> int:
    """Gives each middle slice of `split` (a LLaMA model's, cut at every layer's attention)
    that has the expected form a FusedSlice, where the native parts were built and the
    layers' linears are packed; returns how many got one."""
    if NATIVE is None:
        return 0
    attached = 0
    layers = model.model.layers
    for j, piece in enumerate(split.slices):
        if not (0 < j < len(layers) and piece.takes_attention and piece.graph_inputs == ["positions"]
                and len(piece.context_in) == 1 and len(piece.context_out) == 1
                and split.attention_modules[j - 1] == f"model.layers.{j - 1}.self_attn.attn"):
            continue
        if all(isinstance(m, QuantLinear) for m in _linears(model, j)):
            piece.fused = FusedSlice(model, j)
            attached += 1
    return attached
