"""The colocated layout's parts without processes: its configuration rules, the services
`lamina up` starts for it, and the attention pool attending on cores in its own process."""

from __future__ import annotations

import asyncio

import pytest
import torch
from triton_helpers import INTERPRETER_OFF, NO_TRITON

from lamina.model.attention import batched_attention
from lamina.model.config import ModelConfig
from lamina.services.attention.attention_core import AttentionCore
from lamina.services.attention_pool import AttentionPool, SeqRows
from lamina.services.config import ConfigError, load_config
from lamina.services.launch.launcher import service_commands
from lamina.services.wire import RemoteError, StoreKV

CFG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=6,
                  num_kv_heads=3, head_dim=4)


# -- configuration ---------------------------------------------------------------------------
def test_each_model_worker_is_an_attention_worker():
    config = load_config(env={"LAMINA_LAYOUT": "colocated"}, overrides={"model_worker.workers": 3})
    assert config.colocated and config.attention.workers == 3
    assert config.data_plane_processes == 3 + config.prefill.workers  # no attention processes
    apart = load_config(env={}, overrides={"model_worker.workers": 3})
    assert not apart.colocated and apart.attention.workers == 2
    assert apart.data_plane_processes == 2 + 3 + apart.prefill.workers


@pytest.mark.parametrize(("overrides", "message"), [
    ({"layout": "shared"}, "layout must be one of disaggregated, colocated"),
    ({"layout": "colocated", "partition": "head"}, "partition must be request under layout colocated"),
    ({"layout": "colocated", "pipeline.mode": "rotational"}, "pipeline.mode must be fixed under layout colocated"),
    ({"layout": "colocated", "attention.max_workers": 4}, "attention.max_workers must be 0 under layout colocated"),
])
def test_what_needs_attention_workers_apart_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(env={}, overrides=overrides)


def test_lamina_up_starts_no_attention_processes():
    names = [name for name, _, _ in service_commands(load_config(env={}, overrides={
        "layout": "colocated", "model_worker.workers": 2}))]
    assert names == ["model-0", "model-1", "prefill-0", "scheduler", "gateway"]
    apart = [name for name, _, _ in service_commands(load_config(env={}))]
    assert apart[:2] == ["attention-0", "attention-1"]


# -- the pool's local path -------------------------------------------------------------------
def _kv(n: int) -> torch.Tensor:
    return torch.randn(n, 3, 4)


def _prompted(core: AttentionCore, seq_id: str, n: int) -> tuple[list, list]:
    ks, vs = [_kv(n) for _ in range(2)], [_kv(n) for _ in range(2)]
    for layer in range(2):
        core.store(StoreKV(seq_id, layer, 2, ks[layer], vs[layer]))
    return ks, vs


def test_local_cores_attend_in_row_order_with_nothing_sent():
    """Two sequences on two local cores, their rows interleaved in the step: the pool
    answers each layer as attention over each sequence's own prompt and new token."""
    torch.manual_seed(0)
    cores = [AttentionCore(CFG, capacity_bytes=1 << 20, num_kv_heads=3) for _ in range(2)]
    prompts = {"a": _prompted(cores[0], "a", 5), "b": _prompted(cores[1], "b", 3)}

    async def step() -> None:
        pool = AttentionPool([None, None], "request", CFG, local=dict(enumerate(cores)))
        try:
            route = pool.route([SeqRows("b", 1, [1]), SeqRows("a", 1, [0])])
            q, k, v = torch.randn(2, 6, 4), _kv(2), _kv(2)
            for layer in range(2):
                out = await pool.attend(("t", layer), layer, route, q, k, v)
                for row, sid in enumerate(("b", "a")):
                    pk, pv = prompts[sid][0][layer], prompts[sid][1][layer]
                    ref, _ = batched_attention(q[row:row + 1], [1], [torch.cat([pk, k[row:row + 1]])],
                                               [torch.cat([pv, v[row:row + 1]])])
                    torch.testing.assert_close(out[row:row + 1], ref)
            assert pool.send_s == 0.0 and pool.local_s > 0.0
        finally:
            await pool.close()

    asyncio.run(step())
    assert (cores[0].slabs.num_tokens("a"), cores[1].slabs.num_tokens("b")) == (6, 4)


def test_a_local_refusal_is_the_remote_error_a_worker_would_send():
    core = AttentionCore(CFG, capacity_bytes=1 << 20, num_kv_heads=3)

    async def step() -> None:
        pool = AttentionPool([None], "request", CFG, local={0: core})
        try:
            route = pool.route([SeqRows("never-stored", 1, [0])])
            with pytest.raises(RemoteError, match="never-stored"):
                await pool.attend(("t", 0), 0, route, torch.randn(1, 6, 4), _kv(1), _kv(1))
        finally:
            await pool.close()

    asyncio.run(step())
    assert core.num_sequences == 0


def test_a_step_on_one_local_core_is_a_plain_call_equal_to_the_awaited_one():
    """What the colocated model worker calls per layer (no task switch): the pool's own
    answer, on a twin core; None where part of the step is on another core."""
    torch.manual_seed(3)
    cores = [AttentionCore(CFG, capacity_bytes=1 << 20, num_kv_heads=3) for _ in range(2)]
    prompt = _prompted(cores[0], "a", 5)
    for layer in range(2):
        cores[1].store(StoreKV("a", layer, 2, prompt[0][layer], prompt[1][layer]))

    async def step() -> None:
        pools = [AttentionPool([None], "request", CFG, local={0: core}) for core in cores]
        two = AttentionPool([None, None], "request", CFG, local=dict(enumerate(cores)))
        try:
            route = pools[0].route([SeqRows("a", 1, [0])])
            here = pools[0].attend_here(route)
            assert here is not None
            assert two.attend_here(two.route([SeqRows("a", 1, [0]), SeqRows("b", 1, [1])])) is None
            remote = AttentionPool([None, None], "request", CFG, local={0: cores[0]})
            assert remote.attend_here(remote.route([SeqRows("b", 1, [1])])) is None
            await remote.close()
            for layer in range(2):
                q, k, v = torch.randn(1, 6, 4), _kv(1), _kv(1)
                awaited = await pools[1].attend(("t", layer), layer, route, q, k, v)
                assert torch.equal(here(layer, q, k, v), awaited)
            assert pools[0].local_s > 0.0
        finally:
            await asyncio.gather(*(p.close() for p in (*pools, two)))

    asyncio.run(step())
    assert cores[0].slabs.num_tokens("a") == cores[1].slabs.num_tokens("a") == 6


@NO_TRITON
@INTERPRETER_OFF  # on a CUDA host the colocated row of tests/e2e/test_stack_cuda.py replays the graphs
def test_a_colocated_step_replayed_whole_equals_the_layer_by_layer_step():
    """A colocated model worker's decode step through its step graphs (SlabStepGraphs, run
    here without capture: the graph's body, its kernels under Triton's interpreter) over
    its core's pools: the logits of the same step attended layer by layer on a twin core,
    the core's sequences extended alike, the attention's CPU time counted; a step with a
    sequence the core does not hold is refused as its attend refuses it, before anything
    is written; a step on two cores is left to the layer-by-layer path."""
    from lamina.model.attention import causal_attention
    from lamina.model.batch import StepBatch
    from lamina.model.step_graphs import SlabStepGraphs
    from lamina.services.model.model_service import ModelSlices

    slices = ModelSlices.load("random:smollm2-135m", "float32")
    cfg = slices.cfg
    split = slices.split
    gen = torch.Generator().manual_seed(0)
    prompts = {s: torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for s, n in (("a", 9), ("b", 14))}
    cores = [AttentionCore(cfg, 64 * cfg.kv_bytes_per_token(4), cfg.num_kv_heads) for _ in range(2)]
    for s, prompt in prompts.items():
        kv: list = []

        def attend(i, q, k, v, kv=kv):
            kv.append((k.clone(), v.clone()))
            return causal_attention(q, k, v)

        with torch.inference_mode():
            split.run(StepBatch.build([s], [prompt], [0]).model_inputs(), attend)
        for layer, (k, v) in enumerate(kv):
            for core in cores:
                core.store(StoreKV(s, layer, cfg.num_layers, k, v))
    graphs = SlabStepGraphs(split, cores[1].slabs.k_pools, cores[1].slabs.v_pools, capture=False)
    seqs = [SeqRows("a", 1, [0]), SeqRows("b", 1, [0])]
    batch = StepBatch.build(["a", "b"], [[prompts["a"][-1]], [prompts["b"][-1]]], [9, 14])

    async def step() -> None:
        pools = [AttentionPool([None], "request", cfg, local={0: core}) for core in cores]
        try:
            want = await slices.forward(0, 0, batch, seqs, pools[0])  # [2, V]
            slices.step_graphs = graphs
            got = await slices.forward(0, 0, batch, seqs, pools[1])
            torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
            assert graphs.replays == 1 and pools[1].local_s > 0.0
            with pytest.raises(RemoteError, match="no KV for sequence"):
                await slices.forward(0, 1, StepBatch.build(["c"], [[1]], [3]), [SeqRows("c", 1, [0])], pools[1])
            assert graphs.replays == 1
            two = AttentionPool([None, None], "request", cfg, local=dict(enumerate(cores)))
            assert two.step_here(two.route([SeqRows("a", 1, [0]), SeqRows("b", 1, [1])])) is None
            await two.close()
        finally:
            slices.step_graphs = None
            await asyncio.gather(*(p.close() for p in pools))

    asyncio.run(step())
    assert [c.slabs.num_tokens("a") for c in cores] == [10, 10] and [c.slabs.num_tokens("b") for c in cores] == [15, 15]
