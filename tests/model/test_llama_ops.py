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
