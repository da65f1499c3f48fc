"""LLaMA models of named shapes with seeded random weights (`random:llama-3.1-8b`).

No large checkpoint can be downloaded where the project is built and tested, yet the
planner's validation and the GPU benchmarks need models of real sizes. A `random:NAME`
(or `random:NAME@SEED`) checkpoint has the dimensions of the real model's
`config.json` (layers, widths, heads, vocabulary, RoPE) and weights drawn from a seeded
normal distribution, written once into the cache as a Hugging Face directory: every
service, `lamina generate`, the benchmarks and transformers then read the very same
weights. The tokenizer is SmolLM2's, shipped in this package (model/smollm2_tokenizer),
so a random model needs no other download: ids past its 49,152 entries exist in the
model's vocabulary and decode to no text.

Each tensor is drawn from its own CPU generator seeded by the seed and the tensor's
name, so the weights are the same on every machine whatever the device they end on,
and stored in bfloat16 (exact in float32 too): half the disk, and the GPU's dtype.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
import shutil
import tempfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from lamina.model.config import ModelConfig, RopeScaling
from lamina.model.errors import CheckpointError

if TYPE_CHECKING:
    import torch

RANDOM_PREFIX = "random:"
VERSION = 3
MARKER = "lamina-random.json"
INIT_STD = 0.02  # transformers' initializer_range for LLaMA models
# SmolLM2's tokenizer's <|im_start|> and <|im_end|> (tests/model/test_random_models.py
# checks them against the shipped tokenizer).
BOS_ID, EOS_ID = 1, 2

_LLAMA3_ROPE = RopeScaling(kind="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_position_embeddings=8192)

# The real checkpoints' config.json dimensions. bos/eos are SmolLM2's tokenizer's
# (set when the directory is written), not the real models'.
SHAPES: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                                num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                                max_position_embeddings=8192, tie_word_embeddings=True),
    "smollm2-360m": ModelConfig(vocab_size=49152, hidden_size=960, intermediate_size=2560, num_layers=32,
                                num_heads=15, num_kv_heads=5, head_dim=64, rope_theta=100000.0,
                                max_position_embeddings=8192, tie_word_embeddings=True),
    "smollm2-1.7b": ModelConfig(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_layers=24,
                                num_heads=32, num_kv_heads=32, head_dim=64, rope_theta=130000.0,
                                max_position_embeddings=8192, tie_word_embeddings=True),
    "llama-3.2-1b": ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                                num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0,
                                rope_scaling=_LLAMA3_ROPE, max_position_embeddings=131072,
                                tie_word_embeddings=True),
    "llama-3.2-3b": ModelConfig(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_layers=28,
                                num_heads=24, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                                rope_scaling=_LLAMA3_ROPE, max_position_embeddings=131072,
                                tie_word_embeddings=True),
    "llama-3.1-8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                                num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                                rope_scaling=replace(_LLAMA3_ROPE, factor=8.0), max_position_embeddings=131072),
}


@dataclass(frozen=True)
class RandomSpec:
    shape: str
    seed: int = 0

    @property
    def name(self) -> str:
        return f"{RANDOM_PREFIX}{self.shape}" + (f"@{self.seed}" if self.seed else "")


def is_random(spec: str | Path | None) -> bool:
    return isinstance(spec, str) and spec.startswith(RANDOM_PREFIX)


def parse_spec(spec: str) -> RandomSpec:
    """`random:NAME` or `random:NAME@SEED`; CheckpointError names the shapes there are."""
    body = spec[len(RANDOM_PREFIX):]
    shape, _, seed = body.partition("@")
    if shape not in SHAPES:
        raise CheckpointError(spec, f"no random model shape {shape!r} (shapes: {', '.join(SHAPES)})")
    if seed and not seed.isdigit():
        raise CheckpointError(spec, f"the seed after '@' must be a non-negative integer, got {seed!r}")
    return RandomSpec(shape, int(seed or 0))


def parameter_count(cfg: ModelConfig) -> int:
    """Weights of a LLaMA model of this shape (tied embeddings counted once)."""
    attn = cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    layer = attn + mlp + 2 * cfg.hidden_size
    embed = cfg.vocab_size * cfg.hidden_size
    return cfg.num_layers * layer + embed * (1 if cfg.tie_word_embeddings else 2) + cfg.hidden_size


def tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight of the checkpoint, as Hugging Face names it, with its shape."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (cfg.q_size, h),
            p + "self_attn.k_proj.weight": (cfg.kv_size, h),
            p + "self_attn.v_proj.weight": (cfg.kv_size, h),
            p + "self_attn.o_proj.weight": (h, cfg.q_size),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def random_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """One weight, bfloat16: norms are ones, everything else N(0, INIT_STD), drawn from a
    generator of its own so that no tensor depends on the order they are made in."""
    import torch  # here: the services that only read a random model's configuration never import it

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    # The CPU generator keeps 32 bits of its seed: the seed and name are hashed into them.
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    return (torch.randn(shape, generator=gen) * INIT_STD).to(torch.bfloat16)


def _cache_dir(spec: RandomSpec, root: Path) -> Path:
    digest = hashlib.sha256(f"{spec.shape}:{spec.seed}:{VERSION}".encode()).hexdigest()[:12]
    return root / "models" / f"random-{spec.shape}-seed{spec.seed}-{digest}"


def written(spec_text: str, root: Path) -> bool:
    return (_cache_dir(parse_spec(spec_text), root) / MARKER).is_file()


def write_tokenizer(out: Path) -> None:
    """SmolLM2's tokenizer files, from this package, into `out`."""
    shipped = resources.files("lamina.model") / "smollm2_tokenizer"
    (out / "tokenizer.json").write_bytes(gzip.decompress((shipped / "tokenizer.json.gz").read_bytes()))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        (out / name).write_bytes((shipped / name).read_bytes())


def materialize(spec_text: str, root: Path) -> Path:
    """The Hugging Face directory of `random:NAME[@SEED]` under root, written on first use
    (one safetensors file per layer, so no more than a few layers are held at once)."""
    spec = parse_spec(spec_text)
    out = _cache_dir(spec, root)
    if (out / MARKER).is_file():
        return out
    from safetensors.torch import save_file  # imports torch: only to write the weights

    cfg = replace(SHAPES[spec.shape], bos_token_id=BOS_ID, eos_token_ids=(EOS_ID,))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp"))
    try:
        tmp.chmod(0o755)
        shapes = tensor_shapes(cfg)
        groups: dict[str, list[str]] = {}
        for name in shapes:  # one file per layer, one for the rest
            key = name.split(".")[2] if name.startswith("model.layers.") else "rest"
            groups.setdefault(key, []).append(name)
        files = {key: f"model-{n:05d}-{key}.safetensors" for n, key in enumerate(groups)}

        def write(key: str) -> None:
            tensors = {name: random_tensor(name, shapes[name], spec.seed) for name in groups[key]}
            save_file(tensors, str(tmp / files[key]), metadata={"format": "pt"})

        # Layers drawn at once on a few threads (torch's generator fills one tensor on one
        # core; an 8B model's 8 billion draws took minutes on one): each tensor has its own
        # generator, so the weights do not depend on the order. A few layers in memory at a time.
        with ThreadPoolExecutor(max(1, min(8, (os.cpu_count() or 1)))) as pool:
            list(pool.map(write, groups))
        weight_map = {name: files[key] for key, names in groups.items() for name in names}
        total = sum(2 * math.prod(shape) for shape in shapes.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}  # what transformers reads
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        hf = cfg.to_hf_dict() | {"torch_dtype": "bfloat16"}
        (tmp / "config.json").write_text(json.dumps(hf, indent=2))
        write_tokenizer(tmp)
        (tmp / MARKER).write_text(json.dumps({"spec": spec.name, "version": VERSION,
                                               "parameters": parameter_count(cfg)}))
        try:
            os.replace(tmp, out)  # whole or absent; another process's finished copy is kept
        except OSError:
            if not (out / MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
