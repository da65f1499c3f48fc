"""4-bit group-wise min-max KV rows: LM-Offload's KV scheme, with per-token groups.

A row is one token's K (or V) of one KV head: D float32 values. It is cut into D / G
groups of G consecutive values (G = 32 where it divides D, else D); each group keeps
its minimum m and its scale s = (max - min) * (1/15), both rounded to float16, and each
value x keeps the code q = clamp(round((x - m) * (1 / s)), 0, 15) (round to nearest
even), computed against the rounded m and s, so that it decodes as m + q * s.

Packed row (`Q4Rows.row_bytes` bytes, uint8):
  [0, D/2)              codes, G/2 bytes per group in group order: byte j of a group
                        holds its value j in the low nibble and value j + G/2 in the
                        high one (so that the kernel decodes 8 values of each half at once)
  [D/2, D/2 + 4 D / G)  float16 pairs (m, s), one per group, in group order

For D = 64 that is 40 bytes per row instead of 256 in float32 (6.4x less).

Both directions give the same bits wherever they run. The native module
(csrc/kv_attention.c, `NATIVE`; None where it was not built) quantizes in the same
operations as the torch path below (float16 rounding in integer arithmetic, a multiply
by the reciprocal where a division could be rewritten). Decoding: q * s is exact in
float32 (a 4-bit integer times an 11-bit significand), so m + q * s rounds once, fused
or not, in the kernel and in `dequantize` alike. The error of a value is at most s / 2,
plus the float16 rounding of m and s (about 2^-11 of the group's largest magnitude);
values are clamped to float16's range first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import lamina.model._kv_attention as NATIVE  # noqa: N812 (a module constant: the native kernel, or None)
except ImportError:  # not built: torch quantizes, to the same bytes
    NATIVE = None

KV_QUANT_CHOICES = ("none", "q4")
_LEVELS = 15  # 4 bits: codes 0..15
_F16_MAX = 65504.0
_GROUP = 32
_INV_LEVELS = torch.tensor(1 / _LEVELS, dtype=torch.float32)  # the C code's 1.0f / 15.0f


@dataclass(frozen=True)
class Q4Rows:
    """The packed layout of rows of `head_dim` values, in groups of `group_size` (32, the
    attention workers' choice; of the whole row where it does not divide head_dim)."""

    head_dim: int
    group_size: int = _GROUP

    def __post_init__(self) -> None:
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"4-bit KV rows need an even head_dim, got {self.head_dim}")
        if self.group_size <= 0 or self.group_size % 2:
            raise ValueError(f"4-bit KV groups must have an even size, got {self.group_size}")

    @property
    def group(self) -> int:
        return self.group_size if self.head_dim % self.group_size == 0 else self.head_dim

    @property
    def num_groups(self) -> int:
        return self.head_dim // self.group

    @property
    def row_bytes(self) -> int:
        return self.head_dim // 2 + 4 * self.num_groups

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., D] float32 -> packed rows uint8 [..., row_bytes]."""
        d, g, ng = self.head_dim, self.group, self.num_groups
        if x.shape[-1] != d or x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"rows to quantize must be float32 [..., {d}] CPU tensors, got {x.dtype} "
                             f"{tuple(x.shape)} on {x.device}")
        lead = x.shape[:-1]
        if NATIVE is not None:
            x = x.contiguous()
            out = torch.empty(*lead, self.row_bytes, dtype=torch.uint8)
            NATIVE.quantize(x.data_ptr(), out.data_ptr(), x.numel() // d, d, g)
            return out
        groups = x.reshape(*lead, ng, g).clamp(-_F16_MAX, _F16_MAX)  # [..., NG, G]
        lo, hi = groups.amin(-1), groups.amax(-1)  # [..., NG]
        m = lo.to(torch.float16)
        s = ((hi - lo) * _INV_LEVELS).to(torch.float16)
        mf, sf = m.float().unsqueeze(-1), s.float().unsqueeze(-1)  # [..., NG, 1]
        inv = torch.where(sf > 0, sf, torch.ones_like(sf)).reciprocal()  # a constant group: every code 0
        q = torch.round((groups - mf) * inv).clamp_(0, _LEVELS).to(torch.uint8)  # [..., NG, G]
        codes = (q[..., : g // 2] | (q[..., g // 2 :] << 4)).reshape(*lead, d // 2)  # [..., D/2]
        params = torch.stack([m, s], dim=-1).reshape(*lead, 2 * ng).view(torch.uint8)  # [..., 4 NG]
        return torch.cat([codes, params], dim=-1)

    def dequantize(self, packed: torch.Tensor) -> torch.Tensor:
        """packed: [..., row_bytes] uint8 -> float32 [..., D]."""
        d, g, ng = self.head_dim, self.group, self.num_groups
        if packed.dtype != torch.uint8 or packed.shape[-1] != self.row_bytes:
            raise ValueError(f"packed rows must be uint8 [..., {self.row_bytes}], got {packed.dtype} "
                             f"{tuple(packed.shape)}")
        lead = packed.shape[:-1]
        codes = packed[..., : d // 2].reshape(*lead, ng, g // 2)  # [..., NG, G/2]
        q = torch.cat([codes & 0x0F, codes >> 4], dim=-1).float()  # [..., NG, G]
        params = packed[..., d // 2 :].contiguous().view(torch.float16).float().reshape(*lead, ng, 2)
        return (q * params[..., 1:] + params[..., :1]).reshape(*lead, d)
