"""The roofline: an operator takes as long as the slower of its compute and its memory
traffic (Williams et al., CACM 2009), at the fractions of peak a device achieves.

This is the common term of Lamina's analysis of decode (the paper's argument that the
non-attention operators become compute-bound as the batch grows while attention stays
memory-bound at any batch, because each request reads its own KV).
"""

from __future__ import annotations

from dataclasses import dataclass

from lamina.planner.hardware import Device


@dataclass(frozen=True)
class Roofline:
    compute_s: float
    memory_s: float

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def is_memory_bound(self) -> bool:
        return self.memory_s >= self.compute_s

    def __add__(self, other: Roofline) -> Roofline:
        return Roofline(self.compute_s + other.compute_s, self.memory_s + other.memory_s)

    def scaled(self, factor: float) -> Roofline:
        return Roofline(self.compute_s * factor, self.memory_s * factor)


def roofline(device: Device, matmul_flops: float, bytes_moved: float, vector_flops: float = 0.0) -> Roofline:
    """`matmul_flops` run on the matrix units, `vector_flops` (dequantization) on the
    element-wise units, both competing for the same cores, so their times add."""
    compute = matmul_flops / device.matmul_flops + vector_flops / device.vector_flops
    return Roofline(compute, bytes_moved / device.achieved_bw)
