"""Prefill time of one prompt on a model worker (a tensor-parallel group of `tp` devices).

Prefill is compute-bound for any real prompt: 2 FLOPs per weight per token for the
linear layers, plus causal attention's 2 * q_size * p^2 FLOPs per layer (QK^T and PV over
the lower triangle), and the LM head for the last token only; the weights are read once.
This is the "prefill" term of Lamina's cost model (prefill runs on the compute devices;
its KV then moves to the attention workers layer by layer).
"""

from __future__ import annotations

from lamina.planner.hardware import Device
from lamina.planner.perf.quantization import FP16, Precision
from lamina.planner.perf.roofline import roofline
from lamina.planner.perf.transfer import allreduce_time
from lamina.planner.shapes import ModelShape


def prefill_time(shape: ModelShape, device: Device, prompt_tokens: float, tp: int = 1,
                 weights: Precision = FP16, prompt_tokens_sq: float | None = None) -> float:
    """Seconds to prefill a prompt of `prompt_tokens` tokens. `prompt_tokens_sq` is the mean
    of p^2 when `prompt_tokens` is a mean over a workload (default: its square)."""
    if prompt_tokens <= 0:
        return 0.0
    p_sq = prompt_tokens ** 2 if prompt_tokens_sq is None else prompt_tokens_sq
    linear = 2.0 * prompt_tokens * shape.num_layers * shape.layer_matmul_params
    attention = 2.0 * shape.num_layers * shape.q_size * p_sq
    head = 2.0 * shape.head_params
    weights_bytes = (shape.num_layers * shape.layer_matmul_params + shape.head_params) * weights.bytes_per_element
    params = shape.num_layers * shape.layer_matmul_params + shape.head_params
    t = roofline(device, (linear + attention + head) / tp, weights_bytes / tp,
                 vector_flops=params * weights.dequant_ops_per_element / tp).seconds
    reduce = allreduce_time(prompt_tokens * shape.hidden_size * 2, tp, device.scaleup_bw, device.scaleup_latency)
    return t + 2 * shape.num_layers * reduce
