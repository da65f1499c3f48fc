"""Model shapes: the sizes the performance models need, from a built-in name, a `random:`
model's shape, a Hugging Face `config.json` or a GGUF file (a
`lamina.model.config.ModelConfig`, read by the repository's one parser).

Counts are elements, not bytes: the precision lives in `perf.quantization`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

from lamina.model.config import ModelConfig


@dataclass(frozen=True)
class ModelShape(ModelConfig):
    """A LLaMA-family decoder's configuration (RMSNorm, RoPE, GQA, SwiGLU) with a name and
    the counts the performance models need."""

    name: str = "model"

    @classmethod
    def of(cls, cfg: ModelConfig, name: str) -> ModelShape:
        """A loaded model's configuration as a shape named `name`."""
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cfg)}, name=name)

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one layer's linear maps: Q, K, V, O and the SwiGLU MLP (gate, up, down)."""
        h = self.hidden_size
        return h * self.q_size + 2 * h * self.kv_size + self.q_size * h + 3 * h * self.intermediate_size

    @property
    def head_params(self) -> int:
        """The LM head (tied or not, it is one [vocab, hidden] matmul per token)."""
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """All weights: layers, norms, the embedding and (untied) the LM head."""
        h = self.hidden_size
        embeddings = self.head_params * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (self.layer_matmul_params + 2 * h) + h + embeddings

    @property
    def matmul_params_per_token(self) -> int:
        """Weights multiplied once per decoded token (the embedding is a lookup, not a matmul)."""
        return self.num_layers * self.layer_matmul_params + self.head_params

    @property
    def kv_elements_per_token(self) -> int:
        """K and V elements one token keeps over all layers."""
        return 2 * self.num_layers * self.kv_size


def _shape(name: str, layers: int, hidden: int, inter: int, heads: int, kv: int, vocab: int,
           tied: bool = False) -> ModelShape:
    return ModelShape(name=name, num_layers=layers, hidden_size=hidden, intermediate_size=inter,
                      num_heads=heads, num_kv_heads=kv, head_dim=hidden // heads, vocab_size=vocab,
                      tie_word_embeddings=tied)


# Sizes from each model's Hugging Face config.json.
BUILTIN: dict[str, ModelShape] = {s.name: s for s in (
    _shape("llama-2-7b", 32, 4096, 11008, 32, 32, 32000),
    _shape("llama-2-13b", 40, 5120, 13824, 40, 40, 32000),
    _shape("llama-2-70b", 80, 8192, 28672, 64, 8, 32000),
    _shape("llama-3-8b", 32, 4096, 14336, 32, 8, 128256),
    _shape("llama-3-70b", 80, 8192, 28672, 64, 8, 128256),
    _shape("smollm2-135m", 30, 576, 1536, 9, 3, 49152, tied=True),
)}


def resolve_model(name_or_config: str) -> ModelShape:
    """What `lamina up --model` takes, as a shape: a built-in name (case-insensitive,
    `Llama-3-70B` or `llama-3-70b`) or a shape `random:` models have (`llama-3.1-8b`,
    with or without the prefix and a seed: lamina.model.random_models, no weights
    written), a `config.json` file, a checkpoint directory holding one, or a `.gguf` file
    (its configuration read as the services read it, the file converted once)."""
    from lamina.model import random_models

    key = name_or_config.strip().lower().replace("_", "-")
    if key in BUILTIN:
        return BUILTIN[key]
    if random_models.is_random(key):
        key = random_models.parse_spec(key).shape  # refuses an unknown shape, naming the known ones
    if key in random_models.SHAPES:
        return ModelShape.of(random_models.SHAPES[key], key)
    path = Path(name_or_config)
    if path.is_file() and path.suffix == ".gguf":
        from lamina.model.checkpoints import checkpoint_name, load_config

        return ModelShape.of(load_config(path), checkpoint_name(path))
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"unknown model {name_or_config!r}: not a built-in name "
                         f"({', '.join(BUILTIN)}), a random model's shape ({', '.join(random_models.SHAPES)}), "
                         "a config.json, a checkpoint directory nor a .gguf file")
    shape = ModelShape.from_hf_dict(json.loads(path.read_text()), source=path)
    return replace(shape, name=path.parent.name or path.stem)
