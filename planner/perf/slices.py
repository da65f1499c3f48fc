"""Decode time of the model slices (everything but attention: QKV/O projections, MLP,
norms, the LM head) on one model worker, a tensor-parallel group of `tp` devices.

Lamina's analysis of the non-attention operators: per decode step they read every weight
once per (micro-)batch and do 2 FLOPs per weight per token, so their time is
max(2 * params * batch / compute, weight bytes / bandwidth) (roofline): flat in the batch
until the batch reaches the device's FLOP-per-byte ratio, then linear. Tensor
parallelism divides both terms by `tp` and adds two all-reduces of the activations per
layer (Megatron-LM's layout). On a machine profiled by `lamina profile` the measured
time of its own matmul kernel per weight and batch size replaces the roofline: the float32
kernel's for unquantized weights (used as measured for fp16 too), the packed kernel's
(`Precision.weight_kernel`) for 4-bit ones where the profile has it, the roofline with the
dequantization FLOPs where it does not; its measured per-layer and per-token overhead (the
operators between the matmuls and dispatch) is added.
"""

from __future__ import annotations

from dataclasses import dataclass

from lamina.planner.hardware import Device
from lamina.planner.perf.quantization import FP16, Precision
from lamina.planner.perf.roofline import Roofline, roofline
from lamina.planner.perf.transfer import allreduce_time
from lamina.planner.shapes import ModelShape

ACTIVATION_BYTES = 2  # activations travel and are stored as 16-bit floats


@dataclass(frozen=True)
class SliceTime:
    """One decode step of one micro-batch on one model worker."""

    layer: Roofline  # the matmuls of one layer
    allreduce_s: float  # per layer, 0 without tensor parallelism
    head: Roofline  # the LM head, once per step
    overhead_s: float = 0.0  # per layer: the measured rest of a layer (profiled machines only)

    def layer_s(self) -> float:
        return self.layer.seconds + self.allreduce_s + self.overhead_s

    def step_s(self, num_layers: int) -> float:
        return num_layers * self.layer_s() + self.head.seconds


def _matmul(device: Device, params: float, batch: int, tp: int, weights: Precision,
            activations_per_token: float) -> Roofline:
    per_device = params / tp
    bytes_moved = per_device * weights.bytes_per_element + batch * activations_per_token * ACTIVATION_BYTES / tp
    # A profiled machine: its own kernel's time, whatever the bound; quantized weights only
    # from their packed kernel's measurement (else the dequantization model below).
    measured = device.measured_linear_s(per_device, batch, weights.weight_kernel) \
        if not weights.is_quantized or weights.weight_kernel else None
    if measured is not None:
        return Roofline(measured, min(measured, bytes_moved / device.achieved_bw))
    return roofline(device, 2.0 * per_device * batch, bytes_moved,
                    vector_flops=per_device * weights.dequant_ops_per_element)


def slice_time(shape: ModelShape, device: Device, batch: int, tp: int = 1,
               weights: Precision = FP16) -> SliceTime:
    if batch < 1 or tp < 1:
        raise ValueError("batch and tp must be positive")
    h = shape.hidden_size
    # Activations read and written per token in one layer: the inputs and outputs of the
    # QKV, O, gate/up and down projections.
    layer_acts = 2 * h + shape.q_size + 2 * shape.kv_size + 3 * shape.intermediate_size + 2 * h
    layer = _matmul(device, shape.layer_matmul_params, batch, tp, weights, layer_acts)
    head = _matmul(device, shape.head_params, batch, tp, weights, h + shape.vocab_size)
    reduce_bytes = batch * h * ACTIVATION_BYTES
    allreduce = 2 * allreduce_time(reduce_bytes, tp, device.scaleup_bw, device.scaleup_latency)
    overhead = device.layer_overhead_s + batch * device.token_overhead_s
    return SliceTime(layer, allreduce, head, overhead)
