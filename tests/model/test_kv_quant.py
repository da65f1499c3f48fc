"""4-bit packed KV rows (lamina.model.kv_quant): error bounds, layout, and the kernel's decoding
against the torch path's."""

from __future__ import annotations

import pytest
import torch

import lamina.model.kv_attention as kv_attention
import lamina.model.kv_quant as kv_quant
from lamina.model.kv_attention import SlotBatch, slot_attention
from lamina.model.kv_quant import KV_QUANT_CHOICES, Q4Rows

needs_native = pytest.mark.skipif(kv_attention.NATIVE is None, reason="model._kv_attention was not built")


def _rows(n: int, heads: int, d: int, seed: int = 0) -> torch.Tensor:
    """[n, heads, d]: per-channel offsets and spreads like real K, plus a constant row and
    one far outside float16's range (clamped)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, d, generator=g) * torch.rand(d, generator=g) * 4 + torch.randn(d, generator=g) * 3
    x[0] = 1.5
    x[1, 0, 0] = 1e6
    return x


@pytest.mark.parametrize("d", [64, 128, 8])
def test_round_trip_error_is_half_a_step_plus_float16_rounding(d):
    layout = Q4Rows(d)
    x = _rows(50, 3, d)
    y = layout.dequantize(layout.quantize(x))  # [50, 3, D]
    groups = x.clamp(-65504, 65504).reshape(50, 3, -1, layout.group)  # [N, H, NG, G]
    lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step = (hi - lo) / 15
    # s / 2, and float16's rounding of m (relative 2^-11) and of s (at most 15 steps' worth)
    bound = step / 2 * (1 + 2**-9) + 2**-11 * (lo.abs() + 15 * step) + 1e-6
    err = (y.reshape_as(groups) - groups).abs()
    assert (err <= bound).all(), (err - bound).max()
    assert torch.equal(y[0], x[0])  # 1.5 is a float16 value: a constant group decodes exactly


def test_packed_layout_sizes():
    assert (Q4Rows(64).group, Q4Rows(64).row_bytes) == (32, 40)  # 32 bytes of codes + 2 x (min, scale)
    assert (Q4Rows(128).group, Q4Rows(128).row_bytes) == (32, 80)
    assert (Q4Rows(8).group, Q4Rows(8).row_bytes) == (8, 8)
    x = torch.randn(7, 3, 64)
    packed = Q4Rows(64).quantize(x)
    assert packed.dtype == torch.uint8 and packed.shape == (7, 3, 40)
    # the (min, scale) pairs follow the codes, in group order
    params = packed[..., 32:].contiguous().view(torch.float16)  # [7, 3, 4]
    assert torch.equal(params[..., 0], x[..., :32].amin(-1).half())
    assert torch.equal(params[..., 2], x[..., 32:].amin(-1).half())
    # byte j of a group: value j in the low nibble, value j + 16 in the high one
    ramp = torch.cat([torch.arange(32.0), torch.zeros(32)])  # group 0: codes 0..15, 15 (min 0, scale ~31/15)
    codes = Q4Rows(64).quantize(ramp)[:32]
    assert torch.equal(codes[:16] & 15, torch.round(torch.arange(16.0) / params_scale(ramp[:32])).to(torch.uint8))
    assert torch.equal(codes[:16] >> 4, torch.round(torch.arange(16.0, 32) / params_scale(ramp[:32])).to(
        torch.uint8).clamp(max=15))
    with pytest.raises(ValueError, match="even head_dim"):
        Q4Rows(7)
    with pytest.raises(ValueError, match="uint8"):
        Q4Rows(64).dequantize(torch.zeros(3, 41, dtype=torch.uint8))


def params_scale(group: torch.Tensor) -> float:
    return float(((group.max() - group.min()) / 15).half())


@needs_native
@pytest.mark.parametrize("d", [64, 8, 48])
def test_native_and_torch_quantization_give_the_same_bytes(monkeypatch, d):
    # magnitudes from 1e-9 (float16 subnormal scales) to 1e5 (clamped), constant groups
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2000, 3, d, generator=g) * torch.logspace(-9, 5, 2000)[:, None, None]
    x[0], x[1, 0, 0], x[2, :, 0] = 1.5, 1e6, -7e4
    native = Q4Rows(d).quantize(x)
    monkeypatch.setattr(kv_quant, "NATIVE", None)
    assert torch.equal(native, Q4Rows(d).quantize(x))


def test_kv_quant_choices_are_the_configs():
    from lamina.services.config import KV_QUANT_CHOICES as CONFIG_CHOICES

    assert CONFIG_CHOICES == KV_QUANT_CHOICES


def _packed_pools(slots: int, heads: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    layout = Q4Rows(d)
    return layout.quantize(_rows(slots, heads, d, seed=1)), layout.quantize(_rows(slots, heads, d, seed=2))


@needs_native
def test_the_kernel_decodes_packed_rows_to_the_same_floats():
    # One key per sequence: the output is that key's V exactly (weight 1), and with
    # queries 8 e_x (D = 64, scale 1/8) the lse is K's value x exactly.
    d, heads, n = 64, 3, 40
    layout = Q4Rows(d)
    k_pool, v_pool = _packed_pools(n, heads, d)
    q = (torch.eye(d) * 8).repeat_interleave(heads, 0).reshape(d, heads, d)  # [D queries, Hq = Hkv, D]
    batch = SlotBatch.build([[s] for s in range(n)], n)
    out, lse = slot_attention(q.repeat(n, 1, 1), [d] * n, k_pool, v_pool, batch, causal=False, packed=layout)
    assert torch.equal(out.view(n, d, heads, d)[:, 0], layout.dequantize(v_pool))
    assert torch.equal(lse.view(n, d, heads).transpose(1, 2), layout.dequantize(k_pool))


@needs_native
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d", [64, 8, 48])  # groups of 32, and of the whole row (scalar, vector)
def test_native_and_torch_paths_agree_on_packed_pools(monkeypatch, causal, d):
    torch.manual_seed(0)
    k_pool, v_pool = _packed_pools(400, 3, d)
    lens, query_lens = [150, 70, 1, 129, 0], [1, 3, 1, 2, 0]
    order = torch.randperm(400).tolist()  # scattered slots
    starts = [sum(lens[:i]) for i in range(len(lens))]
    batch = SlotBatch.build([order[s : s + n] for s, n in zip(starts, lens)], 400)
    q = torch.randn(sum(query_lens), 9, d)
    kv_lens = None if causal else [100, 70, 0, 129, 0]
    native = slot_attention(q, query_lens, k_pool, v_pool, batch, kv_lens, causal=causal, packed=Q4Rows(d))
    monkeypatch.setattr(kv_attention, "NATIVE", None)
    torch_path = slot_attention(q, query_lens, k_pool, v_pool, batch, kv_lens, causal=causal, packed=Q4Rows(d))
    torch.testing.assert_close(native[0], torch_path[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(native[1], torch_path[1], atol=1e-5, rtol=1e-5)


def test_packed_pools_of_the_wrong_layout_are_refused():
    k_pool, v_pool = _packed_pools(10, 3, 64)
    batch = SlotBatch.build([[0, 1]], 10)
    with pytest.raises(ValueError, match="uint8"):
        slot_attention(torch.randn(1, 3, 128), [1], k_pool, v_pool, batch, packed=Q4Rows(128))
    with pytest.raises(ValueError, match="float32"):
        slot_attention(torch.randn(1, 3, 64), [1], k_pool, v_pool, batch)
