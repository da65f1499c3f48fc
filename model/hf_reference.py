"""transformers' causal LM of a checkpoint directory: the peer our greedy output is
checked against and benchmarked beside, loaded alike on every transformers the project
meets. The dev install pins transformers 5; a GPU machine's image may hold a 4.x, whose
`from_pretrained` takes the dtype as `torch_dtype` (`dtype` from 4.56 on)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def dtype_argument(version: str, dtype: torch.dtype) -> dict[str, Any]:
    """from_pretrained's dtype keyword for transformers `version`."""
    major, minor = (int(part) for part in version.split(".")[:2])
    return {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": dtype}


def reference_model(weights_dir: str | Path, dtype: torch.dtype, device: torch.device | str | None = None) -> Any:
    """transformers' model of `weights_dir` in `dtype`, on `device` (default: where it
    loads), in eval mode, its generate left eager (`disable_compile`: with a static cache
    transformers would compile the decode step on a GPU, its compile time landing in
    whatever is timed)."""
    import transformers

    model: Any = transformers.AutoModelForCausalLM.from_pretrained(
        str(weights_dir), **dtype_argument(transformers.__version__, dtype))
    model.generation_config.disable_compile = True
    if device is not None:
        model = model.to(device)
    return model.eval()
