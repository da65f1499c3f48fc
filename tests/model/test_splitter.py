"""The automated splitter on LLaMA and on a structurally different model."""

import torch
from torch import nn

from lamina.model.attention import attention_with_lse
from lamina.model.config import ModelConfig
from lamina.model.llama import MLP, AttentionOp, RMSNorm, is_attention_op, split_llama
from lamina.model.rope import apply_rope, inverse_frequencies, rope_cos_sin
from lamina.model.splitter import split_model


class _Dense:
    def attend(self, layer_id, q, k, v):
        return attention_with_lse(q, k, v)[0]


def _dense(i, q, k, v):
    return attention_with_lse(q, k, v)[0]


def test_llama_cut_is_the_residual_stream(loaded_model):
    split = split_llama(loaded_model.model, example_tokens=8)
    cfg = loaded_model.config
    assert len(split.slices) == cfg.num_layers + 1
    # Each cut carries d values per token (float32), and nothing bigger.
    assert split.cut_bytes == [8 * cfg.hidden_size * 4] * cfg.num_layers
    for s in split.slices[:-1]:
        assert len(s.context_out) == 1
    ids = torch.tensor(loaded_model.tokenizer.encode("Slices of a model, composed again"))
    inputs = {"input_ids": ids, "positions": torch.arange(len(ids)), "logits_index": torch.arange(len(ids))}
    with torch.inference_mode():
        out0 = split.slices[0](inputs)
        q, k, v = out0.qkv
        # Q leaves the slice separately from K and V, so it can be sent first.
        assert q.shape == (len(ids), cfg.num_heads, cfg.head_dim)
        assert k.shape == v.shape == (len(ids), cfg.num_kv_heads, cfg.head_dim)
        assert out0.context[0].shape == (len(ids), cfg.hidden_size)
        expected = loaded_model.model(inputs["input_ids"], inputs["positions"], inputs["logits_index"], _Dense())
        got = split.run(inputs, _dense)
    assert torch.equal(got, expected)


def test_async_runner_equals_the_synchronous_one_and_runs_slices_through_run_slice(loaded_model):
    """run_async awaits attention and, when given, each slice's runner (a remote
    executor in the stack); either way it composes the slices as run does."""
    import asyncio

    split = split_llama(loaded_model.model, example_tokens=8)
    ids = torch.tensor(loaded_model.tokenizer.encode("Slices run by callbacks"))
    inputs = {"input_ids": ids, "positions": torch.arange(len(ids)), "logits_index": torch.arange(len(ids))}
    ran: list[int] = []
    grad_at_attend: list[bool] = []

    async def attend(i, q, k, v):
        await asyncio.sleep(0)  # other tasks run here: no grad mode may be held across it
        grad_at_attend.append(torch.is_inference_mode_enabled())
        return _dense(i, q, k, v)

    async def run_slice(j, inputs, attn, context):
        ran.append(j)
        with torch.inference_mode():
            return split.slices[j](inputs, attn, context)

    with torch.inference_mode():
        expected = split.run(inputs, _dense)
    assert torch.equal(asyncio.run(split.run_async(inputs, attend)), expected)
    assert not any(grad_at_attend)
    assert torch.equal(asyncio.run(split.run_async(inputs, attend, run_slice)), expected)
    assert ran == list(range(len(split.slices)))


class _ParallelBlock(nn.Module):
    """Attention and MLP read the same normed input (GPT-J/PaLM style), and every
    block also reads the embedding through an extra residual branch."""

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size)
        self.o = nn.Linear(cfg.q_size, cfg.hidden_size)
        self.mlp = MLP(cfg)
        self.attn = AttentionOp(layer_id)
        self.cfg = cfg

    def forward(self, x, x0, cos, sin, ctx):
        c = self.cfg
        h = self.norm(x + 0.5 * x0)
        q, k, v = self.qkv(h).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = apply_rope(q.reshape(-1, c.num_heads, c.head_dim), cos, sin)
        k = apply_rope(k.reshape(-1, c.num_kv_heads, c.head_dim), cos, sin)
        v = v.reshape(-1, c.num_kv_heads, c.head_dim)
        a = self.attn(q, k, v, ctx).reshape(-1, c.q_size)
        return x + self.o(a) + self.mlp(h)


class _ParallelModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(_ParallelBlock(cfg, i) for i in range(cfg.num_layers))
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size)
        self.register_buffer("inv_freq", inverse_frequencies(cfg.head_dim, 10000.0, cfg.rope_scaling))

    def forward(self, input_ids, positions, ctx):
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        x0 = self.embed(input_ids)
        x = x0
        for b in self.blocks:
            x = b(x, x0, cos, sin, ctx)
        return self.head(x)


def test_split_of_a_parallel_block_model_with_an_extra_residual_branch():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=4,
                      num_heads=4, num_kv_heads=2, head_dim=16)
    model = _ParallelModel(cfg).eval()
    n = 6
    example = {"input_ids": torch.randint(0, 100, (n,)), "positions": torch.arange(n), "ctx": _Dense()}
    with torch.no_grad():
        split = split_model(model, example, is_attention_op)
    assert len(split.slices) == cfg.num_layers + 1
    # In a parallel block the MLP reads the normed input h, computed before attention,
    # so every cut also carries h or the MLP's output (d values); the middle cuts carry
    # the residual, the embedding branch and the MLP output (3d); the first cut needs
    # no separate residual (it is the embedding) and the last no embedding branch.
    d_bytes = n * cfg.hidden_size * 4
    assert split.cut_bytes == [2 * d_bytes, 3 * d_bytes, 3 * d_bytes, 2 * d_bytes]
    assert [len(s.context_out) for s in split.slices[:-1]] == [2, 3, 3, 2]
    # Slices never receive a value they do not use or hand on.
    for prev, nxt in zip(split.slices, split.slices[1:]):
        assert prev.context_out == nxt.context_in
    ids = torch.randint(0, 100, (9,))
    inputs = {"input_ids": ids, "positions": torch.arange(9)}
    with torch.no_grad():
        expected = model(ids, inputs["positions"], _Dense())
        got = split.run(inputs, _dense)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_a_model_placed_off_the_cpu_is_split_where_it_is():
    """A second engine on a model the first one placed on a GPU splits it there: the
    split's example inputs run through the model (shape propagation), so they follow its
    parameters. The meta device stands in for the GPU (any device but the CPU fails the
    same way when the example stays on the CPU)."""
    from lamina.model.loader import load_model

    placed = load_model("random:smollm2-135m", packed=False).model.to("meta")
    split = split_llama(placed)
    assert len(split.slices) == split.num_attention + 1 == placed.config.num_layers + 1
