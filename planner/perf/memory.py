"""Memory capacity: weight bytes, KV bytes per token, and how many tokens of KV fit.

Lamina's cost analysis rests on this: a model worker must hold the weights (and, when
colocated, the KV), an attention worker only KV, so the KV capacity of the attention pool
bounds the batch, and the batch bounds how well the model workers' compute is used.
"""

from __future__ import annotations

import math

from lamina.planner.perf.quantization import FP16, Precision
from lamina.planner.shapes import ModelShape

# Fraction of device memory kept back for activations, workspace and fragmentation.
RESERVED_FRACTION = 0.1
TENSOR_PARALLEL_DEGREES = (1, 2, 4, 8)


def weight_bytes(shape: ModelShape, weights: Precision = FP16) -> float:
    """Every weight; norms and embeddings are counted at the same precision (small)."""
    return shape.num_params * weights.bytes_per_element


def kv_bytes_per_token(shape: ModelShape, kv: Precision = FP16) -> float:
    """K and V of one token over all layers."""
    return shape.kv_elements_per_token * kv.bytes_per_element


def usable_bytes(memory_bytes: float, devices: int = 1) -> float:
    return devices * memory_bytes * (1 - RESERVED_FRACTION)


def kv_token_capacity(memory_bytes: float, devices: int, resident_bytes: float, kv_per_token: float) -> int:
    """Tokens of KV that fit in `devices` devices after `resident_bytes` (weights); 0 if none."""
    free = usable_bytes(memory_bytes, devices) - resident_bytes
    return max(0, math.floor(free / kv_per_token))


def min_tensor_parallel(shape: ModelShape, memory_bytes: float, weights: Precision,
                        headroom: float = 0.0) -> int | None:
    """The smallest tensor-parallel degree whose devices hold the weights and leave
    `headroom` (a fraction of usable memory) free; None if even 8 devices do not."""
    need = weight_bytes(shape, weights)
    for tp in TENSOR_PARALLEL_DEGREES:
        if shape.num_kv_heads % tp and tp > 1:
            continue
        if need <= usable_bytes(memory_bytes, tp) * (1 - headroom):
            return tp
    return None
