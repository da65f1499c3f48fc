"""4-bit group-wise min-max KV rows: LM-Offload's KV scheme, with per-token groups.

A row is one token's K (or V) of one KV head: D float32 values. It is cut into D / G
groups of G consecutive values (G = 32 where it divides D, else D); each group keeps
its minimum m and its scale s = (max - min) / 15, both rounded to float16, and each
value x keeps the code q = clamp(round((x - m) / s), 0, 15), computed against the
rounded m and s, so that it decodes as m + q * s.

Packed row (`Q4Rows.row_bytes` bytes, uint8):
  [0, D/2)              codes: value 2i in the low nibble of byte i, value 2i + 1 in the high one
  [D/2, D/2 + 4 D / G)  float16 pairs (m, s), one per group, in group order

For D = 64 that is 40 bytes per row instead of 256 in float32 (6.4x less).

Decoding is exact to the bit wherever it runs: q * s is exact in float32 (a 4-bit
integer times an 11-bit significand), so m + q * s rounds once, fused or not; the
kernel (csrc/kv_attention.c) and `dequantize` give the same floats. The error of a
value is at most s / 2, plus the float16 rounding of m and s (about 2^-11 of the
group's largest magnitude); values are clamped to float16's range first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_QUANT_CHOICES = ("none", "q4")
_LEVELS = 15  # 4 bits: codes 0..15
_F16_MAX = 65504.0
_GROUP = 32


@dataclass(frozen=True)
class Q4Rows:
    """The packed layout of rows of `head_dim` values."""

    head_dim: int

    def __post_init__(self) -> None:
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"4-bit KV rows need an even head_dim, got {self.head_dim}")

    @property
    def group(self) -> int:
        return _GROUP if self.head_dim % _GROUP == 0 else self.head_dim

    @property
    def num_groups(self) -> int:
        return self.head_dim // self.group

    @property
    def row_bytes(self) -> int:
        return self.head_dim // 2 + 4 * self.num_groups

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., D] float -> packed rows uint8 [..., row_bytes]."""
        d, g, ng = self.head_dim, self.group, self.num_groups
        if x.shape[-1] != d:
            raise ValueError(f"rows of {x.shape[-1]} values for a layout of {d}")
        lead = x.shape[:-1]
        groups = x.float().reshape(*lead, ng, g).clamp(-_F16_MAX, _F16_MAX)  # [..., NG, G]
        lo, hi = groups.amin(-1), groups.amax(-1)  # [..., NG]
        m = lo.to(torch.float16)
        s = ((hi - lo) / _LEVELS).to(torch.float16)
        mf, sf = m.float().unsqueeze(-1), s.float().unsqueeze(-1)  # [..., NG, 1]
        safe = torch.where(sf > 0, sf, torch.ones_like(sf))  # a constant group: every code 0
        q = torch.round((groups - mf) / safe).clamp_(0, _LEVELS).to(torch.uint8).reshape(*lead, d)
        codes = q[..., 0::2] | (q[..., 1::2] << 4)  # [..., D/2]
        params = torch.stack([m, s], dim=-1).reshape(*lead, 2 * ng).view(torch.uint8)  # [..., 4 NG]
        return torch.cat([codes, params], dim=-1)

    def dequantize(self, packed: torch.Tensor) -> torch.Tensor:
        """packed: [..., row_bytes] uint8 -> float32 [..., D]."""
        d, g, ng = self.head_dim, self.group, self.num_groups
        if packed.dtype != torch.uint8 or packed.shape[-1] != self.row_bytes:
            raise ValueError(f"packed rows must be uint8 [..., {self.row_bytes}], got {packed.dtype} "
                             f"{tuple(packed.shape)}")
        lead = packed.shape[:-1]
        codes = packed[..., : d // 2]
        q = torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(*lead, ng, g).float()  # [..., NG, G]
        params = packed[..., d // 2 :].contiguous().view(torch.float16).float().reshape(*lead, ng, 2)
        return (q * params[..., 1:] + params[..., :1]).reshape(*lead, d)
