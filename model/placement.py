"""A loaded model and its slices moved to a device and cast to a dtype.

On the CPU in float32 the linears are packed (lamina.model.packing) and run on the
native kernels; anywhere else a model is loaded with torch's own linears
(`load_model(..., packed=False)`) and placed here: every module that holds tensors (the
model and each slice, which keeps its own references to buffers such as RoPE's
frequencies) moves to the device, and the parameters, shared by all of them, take the
dtype. Buffers stay float32, as transformers keeps RoPE's frequencies whatever the
weights' dtype, so positions rotate as precisely in bfloat16 as in float32.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from lamina.model.quant import QuantEmbedding, QuantLinear

# Dtypes a model computes in off the packed kernels (torch's names).
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


def is_packed(model: nn.Module) -> bool:
    return any(isinstance(m, (QuantLinear, QuantEmbedding)) for m in model.modules())


def runs_natively(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the packed CPU kernels serve this device and dtype (else: plain linears)."""
    return device.type == "cpu" and dtype == torch.float32


def place(modules: Iterable[nn.Module], device: torch.device, dtype: torch.dtype) -> None:
    """Move every module to `device` and its parameters to `dtype`, in place."""
    modules = list(modules)
    if any(map(is_packed, modules)) and not runs_natively(device, dtype):
        raise ValueError(f"packed weights run on the CPU in float32, not on {device} in {dtype}: "
                         "load the model with packed=False")
    for module in modules:
        module.to(device)
    params = {id(p): p for m in modules for p in m.parameters()}
    for p in params.values():
        p.data = p.data.to(dtype)
