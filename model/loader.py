"""Loading a checkpoint into the model: weights read, packed for the CPU kernels, and the
tokenizer (lamina.model.checkpoints finds and converts the checkpoint)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lamina.model.checkpoints import PACKED_CACHE, read_hf_config, resolve_checkpoint
from lamina.model.config import ModelConfig
from lamina.model.errors import CheckpointError
from lamina.model.llama import LlamaForCausalLM, checkpoint_names
from lamina.model.quant import PACKED_LAYOUT_VERSION, PackedWeight
from lamina.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    source: Path  # the checkpoint the user named
    weights_dir: Path  # the Hugging Face-layout directory the weights were read from
    load_seconds: float
    was_cached: bool  # False when this load converted a GGUF file
    weights: str = "float32"  # the weights choice it was loaded with (lamina.model.packing.WEIGHT_CHOICES)
    weight_formats: dict[str, int] = field(default_factory=dict)  # packed format -> matrices in it


def read_hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(directory, "no *.safetensors weight files in the checkpoint directory")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f, f"corrupt safetensors file: {exc}") from exc
    return state


def build_model(cfg: ModelConfig, state: dict[str, torch.Tensor], source: Path, dtype: torch.dtype) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    # Parameters made in `dtype` at once (an 8B model made in float32 and then converted
    # would take its float32 bytes of memory on top of the checkpoint's). torch.empty, not
    # to_empty: empty_like of a meta tensor imports sympy (a second of every worker's start).
    model = model._apply(lambda t: torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype))
    # inv_freq is derived, not stored: rebuilt after the line above left it uninitialized, in
    # float32 whatever the dtype (as transformers keeps it: RoPE's angles need it).
    from lamina.model.rope import inverse_frequencies

    model.model.inv_freq = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).float()
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    names = checkpoint_names(model.state_dict())  # as the checkpoint spells them (fused ones split)
    expected = {k for k in names if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    missing = sorted(expected - state.keys())
    if missing:
        raise CheckpointError(source, f"weights missing from checkpoint: {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    try:
        model.load_state_dict(state, strict=False, assign=False)
    except RuntimeError as exc:
        raise CheckpointError(source, f"weights do not fit the configuration: {exc}") from exc
    return model.eval().requires_grad_(False)


def load_model(path: str | Path | None = None, dtype: torch.dtype = torch.float32,
               weights: str = "float32", packed: bool = True) -> LoadedModel:
    """Load a checkpoint directory or GGUF file (default: SmolLM2-135M-Instruct).

    weights: how the linears hold their weights (lamina.model.packing): "float32", "q8_0",
    "q4" (group-wise min-max 4-bit), or "as_file" (a GGUF's own Q8_0 / Q4_0 / Q4_1
    blocks kept as they are; float checkpoints stay float32). Packed weights compute
    in float32: any other dtype needs weights="float32". packed=False keeps torch's own
    linears (weights="float32" only): what runs on devices other than the CPU.
    """
    from lamina.model.packing import check_weights, pack_model

    start = time.perf_counter()
    check_weights(weights)
    if dtype != torch.float32 and weights != "float32":
        raise ValueError(f"packed weights ({weights}) compute in float32; dtype {dtype} needs weights='float32'")
    source, weights_dir, was_cached = resolve_checkpoint(path)
    cfg = read_hf_config(weights_dir)
    state = read_hf_weights(weights_dir)
    model = build_model(cfg, state, weights_dir, dtype)
    del state
    formats: dict[str, int] = {}
    if not packed and weights != "float32":
        raise ValueError(f"weights={weights!r} are packed; packed=False needs weights='float32'")
    if dtype == torch.float32 and packed:
        with _one_thread():
            from_file = file_packed(source, weights_dir, cfg) if weights == "as_file" else None
            formats = pack_model(model, weights, from_file)
    tokenizer = Tokenizer.from_dir(weights_dir, cfg)
    return LoadedModel(model, cfg, tokenizer, source, weights_dir, time.perf_counter() - start, was_cached,
                       weights, formats)


@contextlib.contextmanager
def _one_thread():
    """Packing is byte shuffling over a few hundred MB: one thread does it at memory speed,
    while OpenMP workers waiting on a busy core (2 shared cores) slow it down tenfold."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def file_packed(source: Path, weights_dir: Path, cfg: ModelConfig) -> dict[str, PackedWeight]:
    """A GGUF file's matrices in the block formats the kernels read (none for other
    checkpoints), repacked once into the conversion cache (`packed/as_file.safetensors`):
    reading the GGUF's metadata alone takes seconds, the repacked file a fraction of one."""
    if not source.is_file():
        return {}
    from safetensors import SafetensorError

    cached = weights_dir / PACKED_CACHE
    if cached.is_file():
        try:
            return _read_packed(cached)
        except (SafetensorError, OSError, ValueError, KeyError) as exc:
            log.warning("rewriting %s: %s", cached, exc)
    from lamina.model import gguf_file

    packed = gguf_file.read_packed(source, cfg, gguf_file._open(source))
    _write_packed(cached, packed)
    return packed


def _write_packed(path: Path, packed: dict[str, PackedWeight]) -> None:
    from safetensors.torch import save_file

    tensors = {f"{name}:{part}": t for name, pw in packed.items() for part, t in pw.tensors().items()}
    shapes = {name: [pw.fmt, pw.n, pw.k] for name, pw in packed.items()}
    path.parent.mkdir(exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")  # not the pid: see convert_gguf
    os.close(fd)
    os.chmod(tmp, 0o644)  # as a file save_file creates, not mkstemp's 0600
    save_file(tensors, str(tmp), metadata={"layout": str(PACKED_LAYOUT_VERSION), "weights": json.dumps(shapes)})
    os.replace(tmp, path)  # whole or absent, whoever else writes it at the same time


def _read_packed(path: Path) -> dict[str, PackedWeight]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("layout") != str(PACKED_LAYOUT_VERSION):
            raise ValueError(f"packed layout {meta.get('layout')}, this version reads {PACKED_LAYOUT_VERSION}")
        shapes = json.loads(meta["weights"])
        tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open has keys() but no __iter__)
    return {name: PackedWeight(fmt, n, k, tensors[f"{name}:values"], tensors.get(f"{name}:scale"),
                               tensors.get(f"{name}:minimum"))
            for name, (fmt, n, k) in shapes.items()}
