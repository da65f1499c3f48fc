"""Rotary position embeddings, with the linear and Llama 3 frequency scalings."""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable

import torch

from lamina.model.config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Per-pair rotation frequencies. Returns [head_dim // 2] float32, on the CPU even
    under a default device: on the meta device models are built on, these few ops would
    import torch._dynamo (seconds of every worker's start)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        return _llama3_scale(inv_freq, scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths (low frequencies) are stretched by `factor`, short ones kept,
    # and the band between them is interpolated smoothly (Llama 3.1 report, sec. 3).
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] int64; inv_freq: [D/2]. Returns cos, sin: [T, 1, D] float32.

    sin carries rotate-half's sign: [-sin f, sin f], so that `apply_rope` needs no
    negation of its own.
    """
    freqs = positions.float()[:, None, None] * inv_freq  # [T, 1, D/2]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, 1, D] from `rope_cos_sin`. Rotates each head's (i, i + D/2) pairs.

    Equals Hugging Face's x * cos + rotate_half(x) * sin bit for bit: the swapped
    halves times the signed sin are rotate_half's products (negation is exact).
    (torch.addcmul would save an operation but fuses the multiply-add, which rounds
    differently.)
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # [T, H, D]
    return x * cos.to(x.dtype) + swapped * sin.to(x.dtype)


# Cos/sin tables per frequency tensor (model/llama.py's native RoPE reads its rows by
# position): id(inv_freq) -> (inv_freq's version when built, cos [R, D], sin [R, D]).
# Dropped with the frequencies.
_TABLES: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}
_TABLES_LOCK = threading.Lock()
MIN_TABLE_ROWS = 1024


def rope_table(inv_freq: torch.Tensor, rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_cos_sin` of positions 0 .. R - 1 (R >= rows, a power of two, at least
    MIN_TABLE_ROWS): cos, sin [R, D] float32 on inv_freq's device, computed once by the
    same torch operations, so a row equals what `rope_cos_sin` gives its position bit for
    bit. Grown when a longer one is asked for; rebuilt if inv_freq changed in place."""
    key = id(inv_freq)
    held = _TABLES.get(key)
    if held is not None and held[0] == inv_freq._version and held[1].shape[0] >= rows:
        return held[1], held[2]
    with _TABLES_LOCK:
        size = max(MIN_TABLE_ROWS, 1 << max(rows - 1, 0).bit_length())
        positions = torch.arange(size, device=inv_freq.device)
        cos, sin = rope_cos_sin(positions, inv_freq)  # [R, 1, D] each
        if key not in _TABLES:
            weakref.finalize(inv_freq, _TABLES.pop, key, None)
        _TABLES[key] = (inv_freq._version, cos[:, 0], sin[:, 0])
    return cos[:, 0], sin[:, 0]


def with_rope_table(inv_freq: torch.Tensor, positions: torch.Tensor,
                    rotate: Callable[[torch.Tensor, torch.Tensor], int]) -> None:
    """Calls rotate(cos, sin) with `rope_table`'s tables ([R, D] each): first the table as
    it is, then, when rotate returns the row of `positions` ([T] int64) that fell outside
    it (it must rotate nothing then), once more with one that holds every position; a
    negative return means done. A negative position raises ValueError."""
    rows = 0
    while True:
        cos, sin = rope_table(inv_freq, rows)
        outside = rotate(cos, sin)
        if outside < 0:
            return
        if int(positions[outside]) < 0:
            raise ValueError(f"negative position {int(positions[outside])}")
        rows = int(positions.max()) + 1
