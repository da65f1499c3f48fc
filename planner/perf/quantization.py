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

    @property
    def is_quantized(self) -> bool:
        return self.group_size is not None

    @property
    def bytes_per_element(self) -> float:
        per_group = 4.0 / self.group_size if self.group_size else 0.0  # fp16 scale + fp16 min
        return self.bits / 8 + per_group

    @property
    def dequant_ops_per_element(self) -> float:
        return DEQUANT_OPS_PER_ELEMENT if self.is_quantized else 0.0


FP16 = Precision("fp16", 16)
FP32 = Precision("fp32", 32)  # the local CPU engine's weights and KV
INT4 = Precision("int4", 4, group_size=64)
PRECISIONS = {p.name: p for p in (FP16, FP32, INT4)}


@dataclass(frozen=True)
class QuantVerdict:
    saved_s: float  # transfer time saved by the smaller form
    cost_s: float  # (de)quantization time added

    @property
    def worth_it(self) -> bool:
        return self.saved_s > self.cost_s


def quantization_verdict(elements: float, bandwidth: float, vector_flops: float,
                         quantized: Precision = INT4, base: Precision = FP16) -> QuantVerdict:
    """Whether streaming `elements` in `quantized` form over a path of `bandwidth` bytes/s,
    dequantized on units of `vector_flops` FLOP/s, beats streaming them in `base` form."""
    saved = elements * (base.bytes_per_element - quantized.bytes_per_element) / bandwidth
    cost = elements * quantized.dequant_ops_per_element / vector_flops
    return QuantVerdict(saved, cost)
