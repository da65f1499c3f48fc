"""The decoder's own operators: fused projections loading Hugging Face names, RoPE and
RMSNorm against transformers' forms."""

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 (torch's conventional name)

from lamina.model import llama
from lamina.model.config import ModelConfig, RopeScaling
from lamina.model.llama import LlamaForCausalLM, checkpoint_names, rms_norm
from lamina.model.rope import apply_rope, inverse_frequencies, rope_cos_sin

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, attention_bias=True)


def _hf_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """A state dict under Hugging Face's names (separate Q, K, V and gate, up)."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, t in LlamaForCausalLM(CFG).state_dict().items():
        for part_name in checkpoint_names([name]):
            rows = {"q_proj": CFG.q_size, "k_proj": CFG.kv_size, "v_proj": CFG.kv_size,
                    "gate_proj": CFG.intermediate_size, "up_proj": CFG.intermediate_size}
            part = part_name.split(".")[-2]
            shape = (rows[part], *t.shape[1:]) if part in rows else t.shape
            state[part_name] = torch.randn(shape, generator=gen)
    return state


def test_fused_projections_load_hugging_face_names():
    state = _hf_state()
    assert "model.layers.1.self_attn.q_proj.bias" in state and "model.layers.0.mlp.up_proj.weight" in state
    model = LlamaForCausalLM(CFG)
    model.load_state_dict(dict(state), strict=True)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    p = "model.layers.1."
    assert torch.equal(attn.qkv_proj.weight, torch.cat([state[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]))
    assert torch.equal(attn.qkv_proj.bias, torch.cat([state[p + f"self_attn.{x}_proj.bias"] for x in "qkv"]))
    assert torch.equal(mlp.gate_up_proj.weight,
                       torch.cat([state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]]))
    # A checkpoint missing a part is reported under the checkpoint's own names.
    del state["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(RuntimeError, match=r"qkv_proj\.weight"):
        LlamaForCausalLM(CFG).load_state_dict(state, strict=True)


def test_rope_equals_transformers_bit_for_bit():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    hf_cfg = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                         max_position_embeddings=8192)
    pos = torch.tensor([0, 1, 5, 100, 4000, 7000])
    q, k = torch.randn(1, 9, len(pos), 64), torch.randn(1, 3, len(pos), 64)
    cos_h, sin_h = LlamaRotaryEmbedding(hf_cfg)(q, pos[None])
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos_h, sin_h)
    cos, sin = rope_cos_sin(pos, inverse_frequencies(64, 100000.0, RopeScaling()))
    # Q and K rotated in one call, as the model does on its fused projection.
    qk = apply_rope(torch.cat([q[0], k[0]]).transpose(0, 1), cos, sin)  # [T, 12, 64]
    assert torch.equal(qk[:, :9], q_ref[0].transpose(0, 1))
    assert torch.equal(qk[:, 9:], k_ref[0].transpose(0, 1))


@pytest.mark.skipif(llama._SLICE_OPS is None, reason="model._slice_ops was not built (no C compiler at install)")
def test_native_rms_norm_differs_from_torch_only_by_summation_order():
    w = torch.randn(576)
    wide = torch.randn(10, 1000) * 3
    for x in (wide[:, :576].contiguous(), wide[:, 100:676]):  # contiguous rows, and rows of a wider tensor
        ours, ref = rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5)
        torch.testing.assert_close(ours, ref, rtol=2e-6, atol=0)
    assert torch.equal(rms_norm(x.double(), w.double(), 1e-5), F.rms_norm(x.double(), (576,), w.double(), 1e-5))


@pytest.mark.skipif(llama._SLICE_OPS is None, reason="model._slice_ops was not built (no C compiler at install)")
def test_native_rotary_equals_the_torch_form_bit_for_bit_and_grows_its_table():
    from lamina.model import rope

    inv_freq = inverse_frequencies(64, 100000.0, RopeScaling())
    qkv = torch.randn(6, 15, 64)  # the fused projection's rows: Q's 9 heads, K's 3, V's 3
    # Positions past the first table (MIN_TABLE_ROWS) make it grow within the call.
    pos = torch.tensor([0, 3, rope.MIN_TABLE_ROWS - 1, rope.MIN_TABLE_ROWS, 5000, 7000])
    want = apply_rope(qkv[:, :12], *rope_cos_sin(pos, inv_freq))
    v = qkv[:, 12:].clone()
    ours = llama.rotary(qkv[:, :12], pos, inv_freq)  # in place over the projection's Q and K heads
    assert torch.equal(ours, want) and ours.data_ptr() == qkv.data_ptr() and torch.equal(qkv[:, 12:], v)
    assert rope.rope_table(inv_freq)[0].shape == (8192, 64)
    # Frequencies changed in place get a new table (a loader fills them after allocating).
    inv_freq.mul_(0.5)
    want = apply_rope(qkv[:, :12], *rope_cos_sin(pos, inv_freq))
    assert torch.equal(llama.rotary(qkv[:, :12], pos, inv_freq), want)
    before = qkv.clone()
    with pytest.raises(ValueError, match="negative position -1"):
        llama.rotary(qkv[:2, :12], torch.tensor([5, -1]), inv_freq)
    assert torch.equal(qkv, before)  # nothing rotated


@pytest.mark.skipif(llama._SLICE_OPS is None, reason="model._slice_ops was not built (no C compiler at install)")
def test_native_residual_add_and_norm_equal_the_two_operators():
    w = torch.randn(576)
    wide = torch.randn(7, 700)
    for x in (torch.randn(7, 576), wide[:, 50:626]):  # contiguous rows, and rows of a wider tensor
        h = torch.randn(7, 576)
        want = x + h
        total, normed = llama.add_rms_norm(x, h, w, 1e-5)
        assert torch.equal(total, want) and total.data_ptr() == h.data_ptr()  # the sum over h, consumed
        assert torch.equal(normed, rms_norm(want, w, 1e-5))


@pytest.mark.skipif(llama._SLICE_OPS is None, reason="model._slice_ops was not built (no C compiler at install)")
def test_native_silu_mul_is_torch_s_within_its_exp_rounding():
    gate_up = torch.randn(9, 2 * 1536) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(llama.silu_mul(gate_up), F.silu(gate) * up, rtol=4e-7, atol=1e-7)


def test_the_fused_operators_fall_back_to_torch_off_float32():
    """bfloat16 (what runs on a GPU) takes torch's operators, as Hugging Face computes them."""
    x, h, w = torch.randn(3, 64).bfloat16(), torch.randn(3, 64).bfloat16(), torch.randn(64).bfloat16()
    total, normed = llama.add_rms_norm(x, h, w, 1e-5)
    assert torch.equal(total, x + h) and torch.equal(normed, F.rms_norm(x + h, (64,), w, 1e-5))
    gate_up = torch.randn(3, 32).bfloat16()
    assert torch.equal(llama.silu_mul(gate_up), F.silu(gate_up[:, :16]) * gate_up[:, 16:])
    qk = torch.randn(3, 4, 8).bfloat16()
    inv_freq, pos = inverse_frequencies(8, 10000.0, RopeScaling()), torch.tensor([1, 2, 3])
    assert torch.equal(llama.rotary(qk, pos, inv_freq), apply_rope(qk, *rope_cos_sin(pos, inv_freq)))
