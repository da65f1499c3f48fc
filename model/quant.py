"""Linear layers whose weights stay packed: float32 panels, Q8_0, Q4_0 and Q4_1.

A `PackedWeight` holds W [N, K] (N outputs, K inputs) in one of four formats, with
its rows grouped in panels of 16 so that one pass of the native kernel
(csrc/qmatmul.c, built into `model._qmatmul`) over a panel produces 16 outputs of
every input row:

| format | values | per output and group of 32 k | w |
| --- | --- | --- | --- |
| `f32`  | float32 `[P, K, 16]` | - | w |
| `q8_0` | int8 `[P, K/32, 32, 16]` | scale d (f16) | d * q |
| `q4_0` | uint8 `[P, K/32, 32, 8]`, two outputs a byte | d (f16) | d * (q - 8) |
| `q4_1` | as q4_0 | d and min m (f16) | d * q + m |

The quantized formats are GGUF's blocks with the same bits (a GGUF tensor is
repacked, never re-quantized), so a file's weights run as the file stores them.
Float weights are quantized like gguf's own quantizer (`quantize`): Q8_0 with
d = max|w| / 127, and 4-bit as Q4_1, which is LM-Offload's group-wise min-max
scheme (per group of 32 along the input dimension, scale (max - min) / 15 and the
min). Decoding uses the reference's operations, so the kernel's products differ
from dequantize-then-matmul only in the order of accumulation.

Where the kernel was not built (`NATIVE is None`) products run in torch: float32
with torch's own linear, quantized weights dequantized at every call (slow, exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 (torch's conventional name)
from torch import nn

try:
    import lamina.model._qmatmul as NATIVE  # noqa: N812 (a module constant: the native kernel, or None)
except ImportError:  # not built (no C compiler at install): products run in torch
    NATIVE = None

PACKED_LAYOUT_VERSION = 1  # bump when the packed tensors' layout changes (caches keyed on it)
PANEL = 16  # outputs per panel
GROUP = 32  # inputs per quantization group
FORMATS = ("f32", "q8_0", "q4_0", "q4_1")
_FORMAT_CODE = {name: i for i, name in enumerate(FORMATS)}  # the kernel's numbering

# Threads the native products split their outputs over, and the native attention kernel
# its sequences (lamina.model.kv_attention, on the same worker pool): process-wide, like
# torch's own intra-op setting; set through model.threads.set_compute_threads.
_kernel_threads = 1


def set_kernel_threads(n: int) -> None:
    """The native products and attention use n threads (the calling one and n - 1
    workers of the products' pool)."""
    global _kernel_threads
    if n < 1:
        raise ValueError(f"threads must be at least 1, got {n}")
    _kernel_threads = n


def kernel_threads() -> int:
    return _kernel_threads
_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}  # one GGUF block of 32 values


@dataclass(frozen=True)
class PackedWeight:
    """W [n, k] packed in panels; see the module docstring for each format's tensors."""

    fmt: str
    n: int
    k: int
    values: torch.Tensor  # f32 [P, K, 16] | int8 [P, G, 32, 16] | uint8 [P, G, 32, 8]
    scale: torch.Tensor | None = None  # float16 [P, G, 16]
    minimum: torch.Tensor | None = None  # float16 [P, G, 16], q4_1 only

    def __post_init__(self) -> None:
        p, g = _panels(self.n), self.k // GROUP
        expected = {
            "f32": (torch.float32, (p, self.k, PANEL)),
            "q8_0": (torch.int8, (p, g, GROUP, PANEL)),
            "q4_0": (torch.uint8, (p, g, GROUP, PANEL // 2)),
            "q4_1": (torch.uint8, (p, g, GROUP, PANEL // 2)),
        }
        if self.fmt not in expected:
            raise ValueError(f"unknown packed format {self.fmt!r} (known: {', '.join(FORMATS)})")
        dtype, shape = expected[self.fmt]
        _check(self.values, dtype, shape, "values")
        if self.fmt != "f32":
            if self.k % GROUP:
                raise ValueError(f"{self.fmt} needs k divisible by {GROUP}, got {self.k}")
            _check(self.scale, torch.float16, (p, g, PANEL), "scale")
        if self.fmt == "q4_1":
            _check(self.minimum, torch.float16, (p, g, PANEL), "minimum")

    @property
    def nbytes(self) -> int:
        """Bytes a product reads (padding of the last panel included)."""
        return sum(t.numel() * t.element_size() for t in (self.values, self.scale, self.minimum) if t is not None)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"values": self.values}
        if self.scale is not None:
            out["scale"] = self.scale
        if self.minimum is not None:
            out["minimum"] = self.minimum
        return out


def _panels(n: int) -> int:
    return (n + PANEL - 1) // PANEL


def _check(t: torch.Tensor | None, dtype: torch.dtype, shape: tuple[int, ...], name: str) -> None:
    # The kernel reads these by address: CPU memory, this exact layout.
    if t is None or t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous() or not t.is_cpu:
        got = "nothing" if t is None else f"{t.dtype} {tuple(t.shape)} on {t.device}"
        raise ValueError(f"packed {name} must be a contiguous CPU {dtype} tensor of shape {shape}, got {got}")


# -- packing ---------------------------------------------------------------------------------


def _to_panels(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [P, 16, ...], rows zero-padded to whole panels."""
    n = t.shape[0]
    pad = _panels(n) * PANEL - n
    if pad:
        t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])
    return t.reshape(-1, PANEL, *t.shape[1:])


def pack_float(w: torch.Tensor) -> PackedWeight:
    """W [N, K] float -> f32 panels [P, K, 16]."""
    n, k = w.shape
    values = _to_panels(w.detach().float()).transpose(1, 2).contiguous()  # [P, K, 16]
    return PackedWeight("f32", n, k, values)


def pack_quantized(fmt: str, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> PackedWeight:
    """From values q [N, K] (int8 for q8_0; 0..15 for the 4-bit formats, before any - 8)
    and float16 scales d (and mins m) [N, K / 32]."""
    n, k = q.shape
    g = k // GROUP
    qp = _to_panels(q.reshape(n, g, GROUP)).permute(0, 2, 3, 1)  # [P, G, 32, 16]
    if fmt == "q8_0":
        values = qp.to(torch.int8).contiguous()
    else:
        qp = qp.to(torch.uint8)
        values = (qp[..., : PANEL // 2] | (qp[..., PANEL // 2 :] << 4)).contiguous()  # [P, G, 32, 8]

    def per_group(s: torch.Tensor) -> torch.Tensor:
        return _to_panels(s.to(torch.float16)).transpose(1, 2).contiguous()  # [P, G, 16]

    return PackedWeight(fmt, n, k, values, per_group(d), None if m is None else per_group(m))


def unpack_quantized(pw: PackedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The inverse of `pack_quantized`: values q [N, K], scales d and mins m (or None) [N, K / 32]."""
    v = pw.values
    if pw.fmt != "q8_0":
        v = torch.cat([v & 0x0F, v >> 4], dim=-1)  # [P, G, 32, 16]
    q = v.permute(0, 3, 1, 2).reshape(-1, pw.k)[: pw.n]  # [N, K]

    def per_row(s: torch.Tensor) -> torch.Tensor:
        return s.transpose(1, 2).reshape(-1, s.shape[1])[: pw.n]  # [N, G]

    assert pw.scale is not None  # every quantized format has scales (checked at construction)
    return q, per_row(pw.scale), None if pw.minimum is None else per_row(pw.minimum)


def concat_rows(parts: list[PackedWeight]) -> PackedWeight:
    """Packed weights of one format and input size stacked along the outputs (a fused projection)."""
    fmt, k = parts[0].fmt, parts[0].k
    if any(p.fmt != fmt or p.k != k for p in parts):
        raise ValueError("only weights of one format and input size stack: "
                         + ", ".join(f"{p.fmt} [{p.n}, {p.k}]" for p in parts))
    if all(p.n % PANEL == 0 for p in parts):  # whole panels: they stack as they are
        stacked = {name: torch.cat([p.tensors()[name] for p in parts]) for name in parts[0].tensors()}
        return PackedWeight(fmt, sum(p.n for p in parts), k, stacked["values"], stacked.get("scale"),
                            stacked.get("minimum"))
    if fmt == "f32":
        return pack_float(torch.cat([dequantize(p) for p in parts]))
    q, d, m = zip(*(unpack_quantized(p) for p in parts))
    return pack_quantized(fmt, torch.cat(q), torch.cat(d), torch.cat(m) if fmt == "q4_1" else None)


def pack_gguf(fmt: str, blocks: np.ndarray, n: int, k: int) -> PackedWeight:
    """A GGUF tensor's raw blocks (uint8, n * k / 32 blocks in row order) repacked, bits unchanged."""
    # A copy: a memory-mapped file's pages are read-only, and the panels are new tensors anyway.
    raw = torch.from_numpy(np.array(blocks, dtype=np.uint8).reshape(n, k // GROUP, _BLOCK_BYTES[fmt]))
    d = raw[..., 0:2].contiguous().view(torch.float16)[..., 0]  # [N, G]
    if fmt == "q8_0":
        q = raw[..., 2:].contiguous().view(torch.int8)  # [N, G, 32]
        return pack_quantized(fmt, q.reshape(n, k), d)
    m = raw[..., 2:4].contiguous().view(torch.float16)[..., 0] if fmt == "q4_1" else None
    qs = raw[..., 4:] if fmt == "q4_1" else raw[..., 2:]  # [N, G, 16]: values i (low) and i + 16 (high)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [N, G, 32]
    return pack_quantized(fmt, q.reshape(n, k), d, m)


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    # gguf's np_roundf, operation for operation
    a = x.abs()
    floored = a.floor()
    return x.sign() * (floored + (2 * (a - floored)).floor())


def quantize(w: torch.Tensor, fmt: str) -> PackedWeight:
    """Float W [N, K] quantized as gguf's quantizer does (q8_0, q4_1), bit for bit."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"cannot quantize {tuple(w.shape)} to {fmt}: the input size must divide by {GROUP}")
    blocks = w.detach().float().reshape(n, k // GROUP, GROUP)  # [N, G, 32]
    if fmt == "q8_0":
        d = blocks.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = _round_half_away(blocks * inv).to(torch.int8)
        return pack_quantized(fmt, q.reshape(n, k), d[..., 0])
    if fmt == "q4_1":
        hi = blocks.amax(-1, keepdim=True)
        lo = blocks.amin(-1, keepdim=True)
        d = (hi - lo) / 15
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = ((blocks - lo) * inv + 0.5).trunc().clamp(0, 15).to(torch.uint8)
        return pack_quantized(fmt, q.reshape(n, k), d[..., 0], lo[..., 0])
    raise ValueError(f"cannot quantize to {fmt!r} (q8_0 or q4_1)")


# -- decoding and products -------------------------------------------------------------------


def _decode(pw: PackedWeight, panels: torch.Tensor | slice, cols: torch.Tensor | slice) -> torch.Tensor:
    """Weights of the chosen panels' chosen columns, [..., K] float32 (the reference's values)."""
    if pw.fmt == "f32":
        return pw.values[panels].transpose(-1, -2)[..., cols, :] if isinstance(cols, slice) else (
            pw.values[panels, :, cols])
    assert pw.scale is not None  # every quantized format has scales (checked at construction)
    if isinstance(cols, slice):  # whole panels: [P, 16, G, 32]
        q = pw.values[panels]
        if pw.fmt != "q8_0":
            q = torch.cat([q & 0x0F, q >> 4], dim=-1)  # [P, G, 32, 16]
        q = q.permute(0, 3, 1, 2)
        d = pw.scale[panels].permute(0, 2, 1)[..., None]  # [P, 16, G, 1]
        m = None if pw.minimum is None else pw.minimum[panels].permute(0, 2, 1)[..., None]
    else:  # one column of each panel: [R, G, 32]
        if pw.fmt == "q8_0":
            q = pw.values[panels, :, :, cols]
        else:
            q = (pw.values[panels, :, :, cols % 8] >> (4 * (cols // 8)).to(torch.uint8)[:, None, None]) & 0x0F
        d = pw.scale[panels, :, cols][..., None]  # [R, G, 1]
        m = None if pw.minimum is None else pw.minimum[panels, :, cols][..., None]
    d = d.float()
    if pw.fmt == "q8_0":
        w = d * q.float()
    elif pw.fmt == "q4_0":
        w = d * (q.to(torch.int8) - 8).float()
    else:
        assert m is not None  # q4_1 has minimums (checked at construction)
        w = d * q.float() + m.float()
    return w.reshape(*w.shape[:-2], pw.k)


def dequantize(pw: PackedWeight) -> torch.Tensor:
    """W [N, K] float32, exactly the values the kernel computes with."""
    return _decode(pw, slice(None), slice(None)).reshape(-1, pw.k)[: pw.n].contiguous()


def dequantize_rows(pw: PackedWeight, rows: torch.Tensor) -> torch.Tensor:
    """Rows of W (an embedding lookup): rows [T] int64 -> [T, K] float32."""
    return _decode(pw, rows // PANEL, rows % PANEL)


def packed_matmul(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None = None,
                  native: bool | None = None) -> torch.Tensor:
    """x [..., K] float32 @ W^T (+ bias) -> [..., N] float32, reading W packed.

    native: None picks the kernel where it was built; False forces torch (tests)."""
    if x.dtype != torch.float32 or x.shape[-1] != pw.k or not x.is_cpu:
        raise ValueError(f"x must be a CPU float32 [..., {pw.k}] tensor, got {x.dtype} {tuple(x.shape)} on {x.device}")
    if native is None:
        native = NATIVE is not None
    if not native:
        w = pw.values.transpose(1, 2).reshape(-1, pw.k)[: pw.n] if pw.fmt == "f32" else dequantize(pw)
        return F.linear(x, w, bias)
    return _native_matmul(x, pw.fmt, pw.n, pw.k, pw.values, pw.scale, pw.minimum, bias)


def _native_matmul(x: torch.Tensor, fmt: str, n: int, k: int, values: torch.Tensor, scale: torch.Tensor | None,
                   minimum: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    # The packed tensors were checked when packed; x's dtype and last size by the caller.
    args = (_FORMAT_CODE[fmt], k, n, values.data_ptr(), 0 if scale is None else scale.data_ptr(),
            0 if minimum is None else minimum.data_ptr(), 0 if bias is None else bias.data_ptr())
    return _run_native(x, args)


def _run_native(x: torch.Tensor, args: tuple[int, ...]) -> torch.Tensor:
    """args: (format code, k, n, values, scale, minimum, bias addresses) -> x @ W^T [..., n]."""
    k, n = args[1], args[2]
    x2 = x if x.dim() == 2 else x.reshape(-1, k)  # [M, K]
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y = x2.new_empty((x2.shape[0], n))  # [M, N] float32
    NATIVE.matmul(x2.data_ptr(), y.data_ptr(), x2.shape[0], *args, False, _kernel_threads)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)


# -- modules ---------------------------------------------------------------------------------


def float_weight(module: nn.Module) -> torch.Tensor:
    """The float32 weight [N, K] of an nn.Linear or a QuantLinear (decoded), for inspection."""
    if isinstance(module, QuantLinear):
        return dequantize(module.packed)
    weight = module.weight
    assert isinstance(weight, torch.Tensor), f"{type(module).__name__} has no weight tensor"
    return weight.detach()


class QuantLinear(nn.Module):
    """nn.Linear's job over a PackedWeight; a leaf for torch.fx (the splitter keeps it whole).

    The packed tensors are buffers, so `.to()` and state dicts carry them; the format
    and shape are fixed at construction."""

    values: torch.Tensor  # buffers, registered in __init__ (scale and minimum where the format has them)
    bias: torch.Tensor | None

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.fmt, self.in_features, self.out_features = weight.fmt, weight.k, weight.n
        for name, t in weight.tensors().items():
            self.register_buffer(name, t)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self._native_args: tuple[int, ...] | None = None
        if self.bias is not None and tuple(self.bias.shape) != (weight.n,):
            raise ValueError(f"bias of shape {tuple(self.bias.shape)} does not fit {weight.n} outputs")

    @property
    def packed(self) -> PackedWeight:
        return PackedWeight(self.fmt, self.out_features, self.in_features, self.values,
                            getattr(self, "scale", None), getattr(self, "minimum", None))

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str) -> QuantLinear:
        """fmt: "f32" (float panels), "q8_0" or "q4_1" (quantized like gguf)."""
        w = linear.weight.detach()
        packed = pack_float(w) if fmt == "f32" else quantize(w, fmt)
        return cls(packed, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, K] -> [T, N]
        if NATIVE is None:
            return packed_matmul(x, self.packed, self.bias, native=False)
        if x.dtype != torch.float32 or x.shape[-1] != self.in_features or not x.is_cpu:
            raise ValueError(f"x must be a CPU float32 [..., {self.in_features}] tensor, got {x.dtype} "
                             f"{tuple(x.shape)} on {x.device}")
        return _run_native(x, self._native_args or self.native_args())

    def native_args(self) -> tuple[int, ...]:
        """The kernel's arguments: (format code, k, n, values, scale, minimum, bias
        addresses, 0 where absent). Looked up once (a decode step makes hundreds of calls)
        and cached: the buffers only change through _apply (.to() and the like) and
        state-dict loads, which drop the cached tuple, so a new one means new addresses."""
        args = self._native_args
        if args is None:
            p = self.packed
            args = self._native_args = (
                _FORMAT_CODE[p.fmt], p.k, p.n, p.values.data_ptr(),
                0 if p.scale is None else p.scale.data_ptr(), 0 if p.minimum is None else p.minimum.data_ptr(),
                0 if self.bias is None else self.bias.data_ptr())
        return args

    def _apply(self, fn, recurse=True):
        self._native_args = None
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        self._native_args = None
        super()._load_from_state_dict(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"


class QuantEmbedding(nn.Module):
    """Embedding lookup that decodes rows of a packed table: the tied LM head's own
    weight (no second copy of the vocabulary), or a table of its own."""

    def __init__(self, table: QuantLinear) -> None:
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [T] int64 -> [T, d] float32
        return dequantize_rows(self.table.packed, ids.reshape(-1)).reshape(*ids.shape, self.embedding_dim)
