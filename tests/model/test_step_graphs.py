"""lamina.model.step_graphs: the engine's decode step as one CUDA graph per (batch bucket,
context bucket). On the CPU a graph's body runs eagerly over its static tensors (the
kernels under Triton's interpreter): the padding rows, the fixed splits, the rows table
filled per step, against the engine's own eager path; on a GPU the same steps are
captured and replayed (tests/model/test_engine_devices.py checks those against
transformers)."""

from __future__ import annotations

import pytest
import torch
from triton_helpers import KERNEL_DEVICES

pytest.importorskip("triton", reason="needs triton (pip install '.[dev]' installs it)")

from lamina.engine.kv import KVStore
from lamina.engine.step import run_step
from lamina.model import step_graphs
from lamina.model.batch import StepBatch
from lamina.model.llama import split_llama
from lamina.model.loader import load_model
from lamina.model.placement import place
from lamina.model.step_graphs import StepGraphs, context_bucket

SENTINEL = 7.0  # what every buffer holds where no step wrote


def test_context_buckets_are_powers_of_two_from_the_smallest():
    assert [context_bucket(n) for n in (1, 511, 512, 513, 2048, 2049)] == [512, 512, 512, 1024, 2048, 4096]


@pytest.fixture
def split_model():
    """Its own for each test: the GPU case moves it to the device."""
    return load_model("random:smollm2-135m", packed=False)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_decode_steps_through_the_graphs_equal_the_eager_steps(split_model, device, monkeypatch):
    """Four sequences, then three (bucket 4's graph again, its last row now padding: the
    buffer of the sequence that finished, still allocated, is not written), three across
    a context bucket's edge (512 -> 1024 keys: a graph of its own), then one (bucket 1):
    each step's logits equal the eager path's (a CPU engine's native kernels; on a GPU
    the buffer kernels launched one by one), its K, V rows are the eager path's, and no buffer changes past the rows a step
    wrote. Three graphs, four replays; several splits a row (multiprocessors=8)."""
    loaded = split_model
    cfg = loaded.config
    split = split_llama(loaded.model)
    dev = torch.device(device)
    if dev.type != "cpu":
        place([loaded.model, *(piece.module for piece in split.slices)], dev, torch.float32)
    lens = {"a": 510, "b": 200, "c": 40, "d": 100}
    gen = torch.Generator().manual_seed(0)
    prompts = {s: torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for s, n in lens.items()}
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
    assert graph_kv.get("a").length == 513


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
