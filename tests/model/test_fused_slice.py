"""A LLaMA model's middle slices in one native call (lamina.model.fused_slice): the same
bits as the traced slices, on the real model and on small ones of every packed format."""

from __future__ import annotations

import pytest
import torch

from lamina.model import fused_slice, quant
from lamina.model.config import ModelConfig
from lamina.model.llama import LlamaForCausalLM, split_llama
from lamina.model.packing import pack_model
from lamina.model.rope import MIN_TABLE_ROWS

pytestmark = pytest.mark.skipif(fused_slice.NATIVE is None,
                                reason="needs the native slice operators and products (model/_slice_ops, "
                                       "model/_qmatmul) built")

# Quantized formats need input sizes divisible by 32; Q, K and V carry a bias.
SMALL = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4,
                    num_kv_heads=2, head_dim=16, attention_bias=True)


def _small(weights: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(SMALL).eval()
    with torch.no_grad():
        for norm in (m for m in model.modules() if type(m).__name__ == "RMSNorm"):
            norm.weight.normal_(1.0, 0.2)  # not all ones: a norm's weight must be read
    pack_model(model, weights)
    return model


def _traced(piece, inputs, attn, context):
    fused, piece.fused = piece.fused, None
    try:
        return piece(inputs, attn, context)
    finally:
        piece.fused = fused


def _assert_same(a, b) -> None:
    assert a.qkv is not None and b.qkv is not None
    for x, y in zip(a.qkv, b.qkv):
        assert x.shape == y.shape and torch.equal(x, y)
    assert len(a.context) == len(b.context) == 1 and torch.equal(a.context[0], b.context[0])


def _case(cfg: ModelConfig, tokens: int, top: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, top, (tokens,), generator=gen)
    attn = torch.randn(tokens, cfg.num_heads, cfg.head_dim, generator=gen)
    residual = torch.randn(tokens, cfg.hidden_size, generator=gen)
    return {"positions": positions}, attn, [residual]


@pytest.mark.parametrize("weights", ["float32", "q8_0", "q4"])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_slices_equal_the_traced_ones_bit_for_bit(weights, threads):
    model = _small(weights)
    split = split_llama(model)
    assert [piece.fused is not None for piece in split.slices] == [False, True, True, True, False]
    before = quant.kernel_threads()
    quant.set_kernel_threads(threads)
    try:
        with torch.inference_mode():
            for j in (1, 2, 3):
                for tokens in (1, 3, 17):
                    inputs, attn, context = _case(SMALL, tokens, 300, seed=j * 100 + tokens)
                    out = split.slices[j].fused(inputs, attn, context)
                    assert out is not None
                    _assert_same(out, _traced(split.slices[j], inputs, attn, context))
    finally:
        quant.set_kernel_threads(before)


def test_the_real_model_runs_fused_with_the_same_bits(loaded_model):
    split = split_llama(loaded_model.model)
    cfg = loaded_model.config
    assert fused_slice.attach(loaded_model.model, split) == cfg.num_layers - 1
    with torch.inference_mode():
        for j in (1, cfg.num_layers // 2, cfg.num_layers - 1):
            inputs, attn, context = _case(cfg, 2, 2000, seed=j)
            out = split.slices[j](inputs, attn, context)  # the slice's own call takes the fused path
            _assert_same(out, _traced(split.slices[j], inputs, attn, context))


def test_a_position_past_the_rope_table_grows_it_and_a_negative_one_is_refused():
    split = split_llama(_small("q8_0"))
    piece = split.slices[2]
    with torch.inference_mode():
        inputs, attn, context = _case(SMALL, 4, 10, seed=1)
        inputs["positions"][2] = 4 * MIN_TABLE_ROWS + 7
        _assert_same(piece.fused(inputs, attn, context), _traced(piece, inputs, attn, context))
        inputs["positions"][1] = -3
        with pytest.raises(ValueError, match="negative position -3"):
            piece.fused(inputs, attn, context)


def test_steps_it_does_not_take_are_left_to_the_traced_slice():
    split = split_llama(_small("float32"))
    piece = split.slices[1]
    with torch.inference_mode():
        long_step = _case(SMALL, fused_slice.FUSED_MAX_TOKENS + 1, 100, seed=2)
        assert piece.fused(*long_step) is None
        _assert_same(piece(*long_step), _traced(piece, *long_step))
        inputs, attn, context = _case(SMALL, 3, 100, seed=3)
        strided = torch.randn(3, 2 * SMALL.hidden_size)[:, ::2]  # rows not contiguous
        assert piece.fused(inputs, attn, [strided]) is None
        assert piece.fused(inputs, attn.double(), context) is None
        assert piece.fused({"positions": inputs["positions"].int()}, attn, context) is None


def test_the_plan_follows_weights_replaced_after_the_split():
    model = _small("q8_0")
    split = split_llama(model)
    piece = split.slices[1]
    with torch.inference_mode():
        case = _case(SMALL, 2, 100, seed=4)
        first = piece.fused(*case)
        norm = model.model.layers[0].post_attention_layernorm
        norm.weight.data = norm.weight.data * 2.5  # new storage: the plan's address is stale
        second = piece.fused(*case)
        _assert_same(second, _traced(piece, *case))
        assert not torch.equal(first.context[0], second.context[0])  # the new weight was read
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state)  # reloaded buffers: the products' cached addresses are dropped
    with torch.inference_mode():
        _assert_same(piece.fused(*case), _traced(piece, *case))


def test_no_fused_slices_for_torch_linears():
    model = LlamaForCausalLM(SMALL).eval()  # nn.Linear weights: what runs on other devices
    assert all(piece.fused is None for piece in split_llama(model).slices)


def test_a_step_marked_for_reuse_writes_into_the_slices_kept_outputs():
    """With REUSE_OUTPUTS a slice writes each step of the same token count into the same
    tensors (no new ones), with the traced slice's bits; another token count, or a step
    over REUSED_MAX_TOKENS, gets new ones; an unmarked step always new ones."""
    from lamina.model.splitter import REUSE_OUTPUTS

    piece = split_llama(_small("q4")).slices[2]
    with torch.inference_mode():
        first_case, second_case = _case(SMALL, 3, 100, seed=5), _case(SMALL, 3, 100, seed=6)
        kept = piece.fused({**first_case[0], REUSE_OUTPUTS: True}, *first_case[1:])
        _assert_same(kept, _traced(piece, *first_case))
        again = piece.fused({**second_case[0], REUSE_OUTPUTS: True}, *second_case[1:])
        _assert_same(again, _traced(piece, *second_case))
        assert [t.data_ptr() for t in (*again.qkv, *again.context)] == [t.data_ptr() for t in
                                                                       (*kept.qkv, *kept.context)]
        assert all(x is y for x, y in zip(again.qkv, kept.qkv))  # Q, K, V are kept too
        assert all(x.is_contiguous() for x in kept.qkv)  # at 3 tokens, rows of their own
        fresh = piece.fused(*second_case)
        assert fresh.context[0].data_ptr() != kept.context[0].data_ptr()
        _assert_same(fresh, again)
        other = _case(SMALL, 4, 100, seed=7)
        resized = piece.fused({**other[0], REUSE_OUTPUTS: True}, *other[1:])
        assert resized.context[0].shape == (4, SMALL.hidden_size)
        _assert_same(resized, _traced(piece, *other))
        big = _case(SMALL, fused_slice.REUSED_MAX_TOKENS + 1, 100, seed=8)
        first_big = piece.fused({**big[0], REUSE_OUTPUTS: True}, *big[1:])
        assert piece.fused({**big[0], REUSE_OUTPUTS: True}, *big[1:]).context[0].data_ptr() \
            != first_big.context[0].data_ptr()


def test_a_run_that_reuses_outputs_equals_one_that_does_not():
    """SplitModel.run with reuse_outputs: the same logits, step after step; while another
    run holds the outputs (another thread), a run makes new ones."""
    from lamina.model.splitter import REUSE_OUTPUTS

    model = _small("q8_0")
    split = split_llama(model)
    seen = []

    def attend(i, q, k, v):  # a stand-in attention that keeps nothing it is given
        seen.append(k.data_ptr())
        return (q[:, : SMALL.num_heads] * 0.5).contiguous()

    with torch.inference_mode():
        for tokens in (1, 1, 5):
            inputs = {"input_ids": torch.arange(tokens) % SMALL.vocab_size, "positions": torch.arange(tokens),
                      "logits_index": torch.tensor([tokens - 1])}
            plain = split.run(inputs, attend)
            seen.clear()
            reused = split.run(inputs, attend, reuse_outputs=True)
            assert torch.equal(plain, reused) and REUSE_OUTPUTS not in inputs
        kept = list(seen)
        seen.clear()
        split.run(inputs, attend, reuse_outputs=True)
        assert seen[1:] == kept[1:]  # the middle slices' K tensors of the step before (slice 0 is traced)
        with split._reuse:  # held by a run on another thread
            seen.clear()
            assert torch.equal(split.run(inputs, attend, reuse_outputs=True), plain)
            assert seen[1:] != kept[1:]
