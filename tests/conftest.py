"""Shared fixtures: the real default model (loaded once per session)."""

from __future__ import annotations

import os
from pathlib import Path

# Float32 products in full float32, in this process and every service a test starts: an
# image may turn TF32 on for cuBLAS through the environment (NVIDIA's containers set
# TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1), which would part float32 greedy tokens from
# transformers' at near ties. Set before torch is imported; the services inherit it.
os.environ["TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"] = "0"
os.environ["NVIDIA_TF32_OVERRIDE"] = "0"

import pytest
import torch

torch.set_float32_matmul_precision("highest")

# Without a GPU, Triton's kernels (lamina.model.paged_decode) run on CPU tensors under its
# interpreter, which is chosen when triton is first imported: before any test imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One intra-op thread: the end-to-end tests run several service processes beside the
# test process on two cores, where OpenMP's spinning threads slow everything down.
torch.set_num_threads(1)

REPO_ROOT = Path(__file__).resolve().parents[1]
TRACES_DIR = REPO_ROOT.parent / "shared" / "traces"


@pytest.fixture(scope="session")
def loaded_model():
    from lamina.model.loader import load_model

    return load_model()


@pytest.fixture(scope="session")
def hf_reference(loaded_model):
    """transformers' own load of the same GGUF checkpoint, float32: the peer we must match."""
    return _transformers_load(loaded_model.source).eval()


def _transformers_load(gguf: Path):
    """transformers' model of the GGUF file `gguf`, float32. transformers reads and
    dequantizes a GGUF file in Python (15 s on two idle cores, near a minute on busy ones), so what it
    made is kept in a directory keyed by the file (path, size, modification time) and
    transformers' version, and later sessions (CI runs four) load that: the same float32
    tensors and configuration, read in seconds. The configuration is kept without its
    GGUF quantization entry (which only says how the weights were read; transformers
    refuses to save a model that has it). The directory appears whole or not at all
    (renamed into place)."""
    import copy
    import hashlib
    import os
    import shutil
    import tempfile

    import transformers
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    from lamina.model.checkpoints import cache_root, content_key

    key = f"{content_key(gguf)}:{transformers.__version__}"
    saved = cache_root() / "transformers-reference" / f"{gguf.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (saved / "model.safetensors").is_file():
        return AutoModelForCausalLM.from_pretrained(str(saved), dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    saved.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=saved.parent, prefix=saved.name + ".tmp"))
    try:
        config = copy.deepcopy(model.config)
        del config.quantization_config
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"))  # tied embeddings once
        os.replace(tmp, saved)
    except OSError:  # no room, or another session saved it meanwhile (theirs is kept): this one has its model
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when renamed
    return model
