"""Reading GGUF checkpoints (llama.cpp's format) with the `gguf` package.

Tensors are dequantized to float32 (or, for the block types the packed kernels
read, repacked as they are: `read_packed`) and renamed to Hugging Face's names. The
llama.cpp converter permutes the rows of the Q and K projections so that RoPE
pairs are interleaved; we undo that so the weights fit the rotate-half RoPE
that Hugging Face checkpoints (and our model) use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from lamina.model.config import ModelConfig, RopeScaling
from lamina.model.errors import CheckpointError
from lamina.model.quant import PackedWeight, pack_gguf

# Quantization types we dequantize (the `gguf` package implements them in numpy).
SUPPORTED_QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# Block types kept packed with `weights="as_file"`: GGUF type -> lamina.model.quant format.
PACKED_TYPES = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _open(path: Path) -> Any:
    import gguf

    if not path.is_file():
        raise CheckpointError(path, "file not found")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError, struct errors, OSError...
        raise CheckpointError(path, f"not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_config(path: Path, reader: Any | None = None) -> ModelConfig:
    reader = reader or _open(path)
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise CheckpointError(path, f"unsupported architecture {arch!r} (supported: llama, qwen2)")
    p = f"{arch}."
    try:
        num_heads = int(_field(reader, p + "attention.head_count"))
        hidden = int(_field(reader, p + "embedding_length"))
        tokens = reader.fields["tokenizer.ggml.tokens"]
        vocab = int(_field(reader, p + "vocab_size", len(tokens.data)))
        scaling_type = _field(reader, p + "rope.scaling.type", "none")
        if scaling_type == "linear":
            scaling = RopeScaling(kind="linear", factor=float(_field(reader, p + "rope.scaling.factor")))
        else:
            scaling = RopeScaling()
        names = {t.name for t in reader.tensors}
        eos = _field(reader, "tokenizer.ggml.eos_token_id")
        return ModelConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(_field(reader, p + "feed_forward_length")),
            num_layers=int(_field(reader, p + "block_count")),
            num_heads=num_heads,
            num_kv_heads=int(_field(reader, p + "attention.head_count_kv", num_heads)),
            head_dim=int(_field(reader, p + "rope.dimension_count", hidden // num_heads)),
            rms_norm_eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(_field(reader, p + "rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(_field(reader, p + "context_length", 2048)),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
            model_type="qwen2" if arch == "qwen2" else "llama",
        )
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(path, f"missing or invalid GGUF metadata: {exc}") from exc


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # Inverse of llama.cpp's permute: [n_head, 2, D/2, ...] interleaving back to [n_head, D/2, 2, ...] halves.
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def read_state_dict(path: Path, cfg: ModelConfig, reader: Any | None = None) -> dict[str, torch.Tensor]:
    """Dequantized float32 tensors under Hugging Face names."""
    import gguf

    reader = reader or _open(path)
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        qtype = t.tensor_type.name
        if qtype not in SUPPORTED_QUANT_TYPES:
            raise CheckpointError(
                path, f"tensor {t.name} has unsupported quantization type {qtype} "
                f"(supported: {', '.join(SUPPORTED_QUANT_TYPES)})"
            )
        name = _hf_name(t.name)
        if name is None:
            continue  # e.g. rope_freqs: recomputed from the configuration
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        except Exception as exc:
            raise CheckpointError(path, f"tensor {t.name} ({qtype}) could not be decoded: {exc}") from exc
        state[name] = torch.from_numpy(np.ascontiguousarray(_undo_rope_permutation(name, w, cfg)))
    return state


def _undo_rope_permutation(name: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Q and K rows back in rotate-half order (any row layout: floats or a row's blocks)."""
    if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
        return _unpermute(w, cfg.num_heads)
    if name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
        return _unpermute(w, cfg.num_kv_heads)
    return w


def read_packed(path: Path, cfg: ModelConfig, reader: Any | None = None) -> dict[str, PackedWeight]:
    """The matrices stored in a format the packed kernels read (`PACKED_TYPES`), under
    Hugging Face names, with their bits unchanged: rows are only reordered (Q and K
    un-permuted like `read_state_dict` does, which moves whole rows of blocks)."""
    reader = reader or _open(path)
    packed: dict[str, PackedWeight] = {}
    for t in reader.tensors:
        fmt = PACKED_TYPES.get(t.tensor_type.name)
        name = _hf_name(t.name)
        if fmt is None or name is None or len(t.shape) != 2:
            continue
        n, k = int(t.shape[1]), int(t.shape[0])  # GGUF lists the fastest dimension first
        blocks = np.asarray(t.data).view(np.uint8).reshape(n, -1)  # a row of K / 32 blocks per output
        packed[name] = pack_gguf(fmt, _undo_rope_permutation(name, blocks, cfg), n, k)
    return packed


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def save_tokenizer(path: Path, out_dir: Path) -> None:
    """Convert the GGUF's tokenizer with transformers (slow, done once) and save it."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise CheckpointError(path, f"tokenizer could not be converted: {exc}") from exc
    tok.save_pretrained(str(out_dir))
