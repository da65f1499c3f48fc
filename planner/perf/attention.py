"""Decode attention time: each request reads all of its KV once per layer, so the time is
the KV bytes over the memory bandwidth (Lamina's central observation: attention's
arithmetic intensity is about the GQA group size, whatever the batch), split evenly over
the attention workers that hold the batch (by heads or by requests).

KV quantized to 4 bits reads fewer bytes and adds dequantization work on the attention
worker's vector units (LM-Offload's trade-off for where attention runs). On a machine
profiled by `lamina profile`, the measured KV bytes/s of its attention kernel replaces the
memory bandwidth for unquantized KV, and for 4-bit KV its measured time per element over
q4 KV (plus quantizing the new rows) replaces the bytes-and-dequantization model; a
profile without the q4 figures leaves 4-bit KV to that model.
"""

from __future__ import annotations

from lamina.planner.hardware import Device
from lamina.planner.perf.quantization import FP16, Precision
from lamina.planner.perf.roofline import Roofline, roofline
from lamina.planner.shapes import ModelShape


def attention_layer_time(shape: ModelShape, device: Device, batch: int, context: float,
                         workers: int = 1, kv: Precision = FP16) -> Roofline:
    """One layer's decode attention for `batch` requests of mean `context` tokens, on each of
    `workers` devices holding an equal share."""
    if batch < 0 or context < 0 or workers < 1:
        raise ValueError("batch and context must be non-negative and workers positive")
    kv_elements = batch * context * 2 * shape.kv_size / workers
    # QK^T and PV: 2 FLOPs per multiply-add, head_dim per (query head, key) pair, twice.
    flops = 4.0 * batch * context * shape.q_size / workers
    if kv.is_quantized and device.attention_q4_s_per_element is not None:
        # A profiled machine's kernel over q4 KV: reading and decoding included, plus
        # quantizing each request's new K and V rows once.
        new_elements = batch * 2 * shape.kv_size / workers
        quantize = new_elements * (device.kv_q4_quantize_s_per_element or 0.0)
        return Roofline(flops / device.matmul_flops, kv_elements * device.attention_q4_s_per_element + quantize)
    t = roofline(device, flops, kv_elements * kv.bytes_per_element,
                 vector_flops=kv_elements * kv.dequant_ops_per_element)
    if device.attention_bw is not None and not kv.is_quantized:  # a profiled machine: its kernel's rate
        return Roofline(t.compute_s, kv_elements * kv.bytes_per_element / device.attention_bw)
    return t
