"""Typed model configuration for the LLaMA family (Llama 1-3, Mistral, Qwen2, SmolLM)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Self

from lamina.model.errors import CheckpointError

# Hugging Face `model_type` values whose checkpoints have the LLaMA layout
# (RMSNorm, RoPE, GQA, SwiGLU). Qwen2 adds a bias on the Q, K and V projections.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `kind` is "default", "linear" or "llama3" (Llama 3.1+)."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope scaling type {self.kind!r}")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def num_groups(self) -> int:
        """Query heads that share one KV head (GQA group size)."""
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """Bytes of K and V one token occupies over all layers."""
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str | Path = "config.json") -> Self:
        """Build from a Hugging Face `config.json` dictionary."""
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                source,
                f"unsupported architecture {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})",
            )
        try:
            num_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            rope = cfg.get("rope_scaling") or {}
            rope_params = cfg.get("rope_parameters") or {}
            if not rope and rope_params.get("rope_type", "default") != "default":
                rope = rope_params
            rope_theta = float(cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0)))
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            return cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=int(cfg.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                rope_theta=rope_theta,
                rope_scaling=_rope_scaling(rope),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                model_type=model_type,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(source, f"invalid model configuration: {exc}") from exc

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face `config.json` form, so transformers can load our cache too."""
        rope: dict[str, Any] | None = None
        if self.rope_scaling.kind != "default":
            rope = {"rope_type": self.rope_scaling.kind, **{
                k: v for k, v in asdict(self.rope_scaling).items() if k != "kind"
            }}
        eos: int | list[int] | None
        eos = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else (
            self.eos_token_ids[0] if self.eos_token_ids else None)
        return {
            "architectures": ["Qwen2ForCausalLM" if self.model_type == "qwen2" else "LlamaForCausalLM"],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "torch_dtype": "float32",
        }


def _rope_scaling(rope: dict[str, Any]) -> RopeScaling:
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return RopeScaling()
    return RopeScaling(
        kind=kind,
        factor=float(rope.get("factor", 1.0)),
        low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)),
    )
