"""Group-wise 4-bit min-max quantization (LM-Offload / FlexGen), used for the host and
disk tiers of the prefix cache.

The tensor is flattened and cut into groups of `group_size` values; each group keeps
its min and scale = (max - min) / 15 and stores round((x - min) / scale) in 4 bits, two
values per byte. Dequantized values are min + q * scale, so the error of each value is
at most scale / 2 = (max - min) / 30 of its group (plus float rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_LEVELS = 15  # 4 bits: q in 0..15


@dataclass(frozen=True)
class QuantizedTensor:
    packed: torch.Tensor  # [ceil(n_padded / 2)] uint8, two 4-bit codes per byte
    mins: torch.Tensor  # [num_groups] float32
    scales: torch.Tensor  # [num_groups] float32
    shape: tuple[int, ...]
    dtype: torch.dtype
    group_size: int

    @property
    def nbytes(self) -> int:
        return (self.packed.numel() * self.packed.element_size()
                + self.mins.numel() * 4 + self.scales.numel() * 4)

    def to(self, device: torch.device | str) -> QuantizedTensor:
        return QuantizedTensor(self.packed.to(device), self.mins.to(device),
                               self.scales.to(device), self.shape, self.dtype,
                               self.group_size)


def quantize_4bit(x: torch.Tensor, group_size: int = 64) -> QuantizedTensor:
    if group_size <= 0 or group_size % 2:
        raise ValueError(f"group_size must be a positive even number, got {group_size}")
    flat = x.detach().reshape(-1).to(torch.float32)
    n = flat.numel()
    pad = (-n) % group_size
    if pad:
        # Pad with the last value so padding never widens a group's range.
        flat = torch.cat([flat, flat[-1:].expand(pad)]) if n else flat.new_zeros(pad)
    groups = flat.view(-1, group_size)  # [G, group_size]
    mins = groups.min(dim=1).values  # [G]
    scales = (groups.max(dim=1).values - mins) / _LEVELS  # [G]
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((groups - mins[:, None]) / safe[:, None]).clamp_(0, _LEVELS)
    q = q.to(torch.uint8).view(-1)  # [n_padded]
    packed = q[0::2] | (q[1::2] << 4)  # [n_padded / 2]
    return QuantizedTensor(packed.contiguous(), mins.contiguous(), scales.contiguous(),
                           tuple(x.shape), x.dtype, group_size)


def dequantize_4bit(qt: QuantizedTensor) -> torch.Tensor:
    low = qt.packed & 0x0F
    high = qt.packed >> 4
    q = torch.stack([low, high], dim=1).view(-1).to(torch.float32)  # [n_padded]
    groups = q.view(-1, qt.group_size)  # [G, group_size]
    x = groups * qt.scales[:, None] + qt.mins[:, None]
    n = 1
    for d in qt.shape:
        n *= d
    return x.view(-1)[:n].view(qt.shape).to(qt.dtype)
