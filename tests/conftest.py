"""Shared fixtures: the real default model (loaded once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

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
    import torch
    from transformers import AutoModelForCausalLM

    path = loaded_model.source
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()
