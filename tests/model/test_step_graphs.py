"""lamina.model.step_graphs: the engine's decode step as one CUDA graph per (batch bucket,
context bucket). On the CPU a graph's body runs eagerly over its static tensors (the
kernels under Triton's interpreter): the padding rows, the fixed splits, the rows table
filled per step, against the engine's own eager path; on a GPU the same steps are
captured and replayed (tests/model/test_engine_devices.py checks those against
transformers)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from triton_helpers import KERNEL_DEVICES

pytest.importorskip("triton", reason="needs triton (pip install '.[dev]' installs it)")

from lamina.engine.kv import KVStore
from lamina.engine.step import run_step
from lamina.model import step_graphs
from lamina.model.attention import causal_attention
from lamina.model.batch import StepBatch
from lamina.model.llama import split_llama
from lamina.model.loader import load_model
from lamina.model.placement import place
from lamina.model.step_graphs import SlabStepGraphs, StepGraphs, context_bucket
from lamina.services.attention.attention_core import AttentionCore
from lamina.services.wire import RemoteError, StoreKV

SENTINEL = 7.0  # what every buffer holds where no step wrote


def test_context_buckets_are_powers_of_two_from_the_smallest():
    assert [context_bucket(n) for n in (1, 511, 512, 513, 2048, 2049)] == [512, 512, 512, 1024, 2048, 4096]


LAYERS = 4  # of random SmolLM2-135M's 30: each graph body repeats per layer, and on the CPU
# Triton's interpreter runs every layer's kernels (all 30 took 42-58 s a test)


@pytest.fixture
def split_model():
    """Its own for each test (the GPU case moves it to the device): random SmolLM2-135M's
    widths, heads and vocabulary, its first LAYERS layers."""
    loaded = load_model("random:smollm2-135m", packed=False)
    loaded.model.model.layers = loaded.model.model.layers[:LAYERS]
    loaded.config = loaded.model.config = replace(loaded.config, num_layers=LAYERS)
    return loaded


# Prompts whose longest crosses a context bucket after two steps: 128 keys, the smallest
# bucket made 128 for these tests (the interpreter's time grows with the keys).
STEP_LENS = {"a": 126, "b": 50, "c": 10, "d": 30}


def _steps_setup(loaded, device: str, seed: int, monkeypatch):
    """The model split (and placed on `device`), the prompts' lengths and random prompts;
    the smallest context bucket 128."""
    monkeypatch.setattr(step_graphs, "CONTEXT_MIN", 128)
    cfg = loaded.config
    split = split_llama(loaded.model)
    dev = torch.device(device)
    if dev.type != "cpu":
        place([loaded.model, *(piece.module for piece in split.slices)], dev, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    prompts = {s: torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for s, n in STEP_LENS.items()}
    return cfg, split, dev, dict(STEP_LENS), prompts


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_decode_steps_through_the_graphs_equal_the_eager_steps(split_model, device, monkeypatch):
    """Four sequences, then three (bucket 4's graph again, its last row now padding: the
    buffer of the sequence that finished, still allocated, is not written), three across
    a context bucket's edge (128 -> 256 keys: a graph of its own), then one (bucket 1):
    each step's logits equal the eager path's (a CPU engine's native kernels; on a GPU
    the buffer kernels launched one by one), its K, V rows are the eager path's, and no
    buffer changes past the rows a step wrote. Three graphs, four replays, one output a
    batch bucket; several splits a row (multiprocessors=8)."""
    cfg, split, dev, lens, prompts = _steps_setup(split_model, device, seed=0, monkeypatch=monkeypatch)
    stores = []
    for _ in range(2):  # the eager path's, the graphs'
        kv = KVStore(cfg, 1 << 30, device=dev if dev.type != "cpu" else None)
        for s, n in lens.items():
            kv.reserve(s, n + 8).buf.fill_(SENTINEL)
        batch = StepBatch.build(list(lens), [prompts[s] for s in lens], [0] * len(lens))
        run_step(split, kv, batch)  # the prompts, eagerly
        stores.append(kv)
    eager_kv, graph_kv = stores
    graphs = StepGraphs(split, dev, capture=dev.type == "cuda", multiprocessors=8)
    last = {s: prompts[s][-1] for s in lens}
    finished = None  # d's buffer once it finished: memory a later sequence could hold
    outputs = []  # where each step's logits are
    for members in (["a", "b", "c", "d"], ["a", "b", "c"], ["a", "b", "c"], ["b"]):
        if finished is None and "d" not in members:
            finished = graph_kv.get("d").buf
            for kv in stores:
                kv.free("d")
            finished.fill_(SENTINEL)
        live = [s for s in lens if s in graph_kv]
        held = {s: graph_kv.get(s).length for s in live}
        before = {s: graph_kv.get(s).buf.clone() for s in live}
        batch = StepBatch.build(members, [[last[s]] for s in members], [held[s] for s in members])
        want = run_step(split, eager_kv, batch)  # [B, V]
        got = run_step(split, graph_kv, batch, step_graphs=graphs)
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
        outputs.append(got.data_ptr())
        for s in live:
            buf, old = graph_kv.get(s).buf, before[s]
            if s in members:  # the new row written, as the eager path wrote it; the rest as it was
                pos = held[s]
                torch.testing.assert_close(buf[:, :, pos], eager_kv.get(s).buf[:, :, pos], atol=2e-4, rtol=1e-4)
                assert torch.equal(buf[:, :, :pos], old[:, :, :pos]) and torch.equal(buf[:, :, pos + 1:],
                                                                                        old[:, :, pos + 1:])
                assert graph_kv.get(s).length == pos + 1
            else:
                assert torch.equal(buf, old) and graph_kv.get(s).length == held[s]
        if finished is not None:
            assert bool((finished == SENTINEL).all())
        last.update(zip(members, want.argmax(-1).tolist()))
    assert (graphs.captures, graphs.replays, graphs.failures) == (3, 4, 0)
    assert graph_kv.get("a").length == 129
    # Bucket 4's graphs (128 and 256 keys) share one output; bucket 1's is another.
    assert outputs[0] == outputs[1] == outputs[2] != outputs[3]


def test_steps_no_graph_serves_are_left_to_the_caller(split_model, monkeypatch):
    """A prompt (several new tokens) and a batch past the largest bucket get None, and
    nothing is written."""
    monkeypatch.setattr(step_graphs, "bucket_for", lambda rows: None if rows > 2 else 2)
    cfg = split_model.config
    graphs = StepGraphs(split_llama(split_model.model), torch.device("cpu"), capture=False)
    kv = KVStore(cfg, 1 << 28)
    bufs = [kv.reserve(s, 8).buf for s in "abc"]
    for b in bufs:
        b.fill_(SENTINEL)
    ids = torch.zeros(3, dtype=torch.long)
    assert graphs.run(bufs[:1], [0], [3], ids, torch.arange(3)) is None
    assert graphs.run(bufs, [0, 0, 0], [1, 1, 1], ids, torch.zeros(3, dtype=torch.long)) is None
    assert graphs.captures == graphs.replays == 0 and all(bool((b == SENTINEL).all()) for b in bufs)


def _prompt_kv(split, prompt: list[int], device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's K, V [P, Hkv, D] of a prompt, by the split model with causal attention."""
    kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def attend(i, q, k, v):
        kv.append((k.clone(), v.clone()))
        return causal_attention(q, k, v)

    batch = StepBatch.build(["p"], [prompt], [0])
    with torch.inference_mode():
        split.run(batch.model_inputs(device), attend)
    return kv


@pytest.mark.parametrize("at_start", [False, True], ids=["lazy", "at-start"])
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_colocated_decode_steps_through_the_graphs_equal_the_cores_own_steps(split_model, device, at_start,
                                                                             monkeypatch):
    """A colocated model worker's steps over its attention core's slab pools
    (SlabStepGraphs): the same four steps as the engine's test, each extended by the core
    (`decode_step`) and replayed, against a twin core attending layer by layer
    (`local_step`): equal logits, each step's new slots written as the twin wrote them,
    every other slot of every layer's pools unchanged (the finished sequence's slots,
    freed and handed out again, included), three graphs and four replays. At start (a
    worker's warm-up, `prepare`): four graphs (batch buckets 1 and 4, context buckets 128
    and 256) made and replayed once before any step, writing nothing into the pools, and none
    made by the steps."""
    cfg, split, dev, lens, prompts = _steps_setup(split_model, device, seed=1, monkeypatch=monkeypatch)
    cores = [AttentionCore(cfg, 1200 * cfg.kv_bytes_per_token(4), cfg.num_kv_heads, device=dev) for _ in range(2)]
    for core in cores:
        for pool in (*core.slabs.k_pools, *core.slabs.v_pools):
            pool.fill_(SENTINEL)
    for s, prompt in prompts.items():
        for layer, (k, v) in enumerate(_prompt_kv(split, prompt, dev)):
            for core in cores:
                core.store(StoreKV(s, layer, cfg.num_layers, k, v))
    eager, graphed = cores
    graphs = SlabStepGraphs(split, graphed.slabs.k_pools, graphed.slabs.v_pools, capture=dev.type == "cuda",
                            multiprocessors=8)
    made = 0
    if at_start:
        before = [p.clone() for p in (*graphed.slabs.k_pools, *graphed.slabs.v_pools)]
        with torch.inference_mode():
            made = graphs.prepare((1, 4), step_graphs.context_buckets_up_to(200))
        assert made == 4 and graphs.replays == 0
        assert all(torch.equal(p, old) for p, old in zip((*graphed.slabs.k_pools, *graphed.slabs.v_pools), before))
    last = {s: prompts[s][-1] for s in lens}
    for members in (["a", "b", "c", "d"], ["a", "b", "c"], ["a", "b", "c"], ["b"]):
        if "d" not in members and graphed.slabs.has_request("d"):
            for core in cores:
                core.free(["d"])
        assert SlabStepGraphs.serves([1] * len(members))
        positions = [graphed.slabs.num_tokens(s) for s in members]
        batch = StepBatch.build(members, [[last[s]] for s in members], positions)
        with torch.inference_mode():
            want = split.run(batch.model_inputs(dev), eager.local_step([(s, 1) for s in members]))  # [B, V]
        before = [p.clone() for p in (*graphed.slabs.k_pools, *graphed.slabs.v_pools)]
        lens_now, slots = graphed.decode_step([(s, 1) for s in members])
        assert lens_now == [p + 1 for p in positions]
        with torch.inference_mode():
            got = graphs.run(lens_now, slots, batch.input_ids, batch.positions)
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
        new = [graphed.slabs.slots(s)[-1] for s in members]
        assert new == [eager.slabs.slots(s)[-1] for s in members]  # the twins hand out the same slots
        pools = (*graphed.slabs.k_pools, *graphed.slabs.v_pools)
        twins = (*eager.slabs.k_pools, *eager.slabs.v_pools)
        for pool, old, twin in zip(pools, before, twins):
            torch.testing.assert_close(pool[new], twin[new], atol=2e-4, rtol=1e-4)
            pool[new] = old[new]
            assert torch.equal(pool, old)  # nothing else written
            pool[new] = twin[new]
        last.update(zip(members, want.argmax(-1).tolist()))
    assert (graphs.captures, graphs.replays, graphs.failures) == (made or 3, 4, 0)
    with pytest.raises(RemoteError, match="no KV for sequence"):
        graphed.decode_step([("d", 1)])
    with pytest.raises(RemoteError, match="appears twice"):
        graphed.decode_step([("a", 1), ("a", 1)])
