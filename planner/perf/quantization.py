"""LM-Offload's quantization model: group-wise min-max 4-bit quantization of weights
and/or KV trades bytes moved (fewer) for (de)quantization work (more), and is worth it
only where the bytes saved take longer to move than the extra work takes to compute.

LM-Offload (its performance models for quantization) makes this choice per tensor kind
given where attention runs: KV read by a CPU attention from CPU memory is dequantized on
slow vector units, KV or weights crossing PCIe save transfer time. `quantization_verdict`
is that comparison for one tensor stream; the planner also evaluates every precision
choice end to end (batch sizes change with KV capacity), see planner.estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

from lamina.planner.hardware import Device

# Element-wise operations to dequantize one 4-bit element: unpack (shift, mask),
# int-to-float, and one fused multiply-add with the group's scale and minimum (2 FLOPs).
DEQUANT_OPS_PER_ELEMENT = 5.0


@dataclass(frozen=True)
class Precision:
    """Storage of weights or KV. `group_size` None: plain `bits`-bit floats; otherwise
    min-max integer groups, each with a 16-bit scale and a 16-bit minimum."""

    name: str
    bits: int
    group_size: int | None = None
    # The packed weight format of lamina.model.quant whose measured kernel stands for this
    # precision's weights on a machine profiled by `lamina profile` (None: not measured).
    weight_kernel: str | None = None
    group_bytes: float = 4.0  # each group's scale and minimum (a scale alone: 2)

    @property
    def is_quantized(self) -> bool:
        return self.group_size is not None

    @property
    def bytes_per_element(self) -> float:
        per_group = self.group_bytes / self.group_size if self.group_size else 0.0
        return self.bits / 8 + per_group

    @property
    def dequant_ops_per_element(self) -> float:
        return DEQUANT_OPS_PER_ELEMENT if self.is_quantized else 0.0


FP16 = Precision("fp16", 16)
FP32 = Precision("fp32", 32)  # the local CPU engine's weights and KV
# LM-Offload's min-max 4-bit is the engine's `q4` weights, stored as GGUF's Q4_1; its KV
# counterpart is the attention workers' q4 KV (lamina.model.kv_quant).
INT4 = Precision("int4", 4, group_size=64, weight_kernel="q4_1")
PRECISIONS = {p.name: p for p in (FP16, FP32, INT4)}
# The GGUF block formats a checkpoint's own weights can stay in (`model.weights: as_file`)
# besides Q4_1: 32 elements to a block with one fp16 scale each, on their measured kernels.
Q8_0 = Precision("q8_0", 8, group_size=32, weight_kernel="q8_0", group_bytes=2.0)
Q4_0 = Precision("q4_0", 4, group_size=32, weight_kernel="q4_0", group_bytes=2.0)
# The precision of each packed format a checkpoint's linears are held in.
PACKED_PRECISIONS = {"q4_1": INT4, "q4_0": Q4_0, "q8_0": Q8_0}


@dataclass(frozen=True)
class QuantVerdict:
    saved_s: float  # transfer time saved by the smaller form
    cost_s: float  # (de)quantization time added

    @property
    def worth_it(self) -> bool:
        return self.saved_s > self.cost_s


def measured_verdict(base_s: float, quantized_s: float, quantized_stream_s: float) -> QuantVerdict:
    """The verdict from measured kernel times for the same elements: `base_s` in the base
    form, `quantized_s` in the quantized form, `quantized_stream_s` the time to stream the
    quantized bytes alone. What the quantized kernel spends beyond streaming its bytes is
    its (de)quantization cost, and the base time beyond that streaming is what it saves, so
    it is worth it exactly when the quantized kernel is the faster."""
    stream = min(quantized_stream_s, quantized_s)
    return QuantVerdict(base_s - stream, quantized_s - stream)


def quantization_verdict(elements: float, bandwidth: float, vector_flops: float,
                         quantized: Precision = INT4, base: Precision = FP16) -> QuantVerdict:
    """Whether streaming `elements` in `quantized` form over a path of `bandwidth` bytes/s,
    dequantized on units of `vector_flops` FLOP/s, beats streaming them in `base` form."""
    saved = elements * (base.bytes_per_element - quantized.bytes_per_element) / bandwidth
    cost = elements * quantized.dequant_ops_per_element / vector_flops
    return QuantVerdict(saved, cost)


# Bytes per element of the packed forms `lamina profile` measures: GGUF's Q4_1 blocks
# (5 bits a weight) and the attention workers' q4 KV rows (40 bytes per 64 values).
Q4_1_BYTES = 5 / 8
Q4_KV_BYTES = 40 / 64
_FLOAT32_BYTES = 4.0


def device_verdicts(device: Device, elements: float = 1e9) -> dict[str, tuple[QuantVerdict, str]]:
    """Whether 4-bit weights (batch-1 decode matmuls) and 4-bit KV (decode attention) pay on
    `device`, per `elements` streamed, and from what: "measured" (a profile's float32 and
    packed kernels) or "dequant model" (quantization_verdict; float32 base on a profiled
    machine, whose engine computes in float32, fp16 elsewhere)."""
    base = FP32 if device.linear_s_per_param else FP16
    bw = device.achieved_bw
    out: dict[str, tuple[QuantVerdict, str]] = {}
    f32_s, q4_s = device.measured_linear_s(elements, 1), device.measured_linear_s(elements, 1, INT4.weight_kernel)
    if f32_s is not None and q4_s is not None:
        out["weights"] = (measured_verdict(f32_s, q4_s, elements * Q4_1_BYTES / bw), "measured")
    else:
        out["weights"] = (quantization_verdict(elements, bw, device.vector_flops, INT4, base), "dequant model")
    attention_bw = device.attention_bw or bw
    if device.attention_bw is not None and device.attention_q4_s_per_element is not None:
        out["kv"] = (measured_verdict(elements * _FLOAT32_BYTES / attention_bw,
                                      elements * device.attention_q4_s_per_element,
                                      elements * Q4_KV_BYTES / attention_bw), "measured")
    else:
        out["kv"] = (quantization_verdict(elements, attention_bw, device.vector_flops, INT4, base), "dequant model")
    return out
