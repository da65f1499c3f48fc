"""Rotational pipelining without a stack: the policies, and slices run on a peer's
slice service over a real TCP connection with the real model.

The attention pool is replaced by plain attention over the step's own rows (what it
computes does not matter here, only that it is the same for every executor), so the
tests compare a coordinator running every slice itself with one sending slices to a
peer, bit for bit.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from lamina import transports
from lamina.model.attention import attention_with_lse
from lamina.model.batch import StepBatch
from lamina.services.attention_pool import SeqRows
from lamina.services.model.model_service import ModelSlices
from lamina.services.model.rotation import LOCAL, coordinator, pick_executor
from lamina.services.model.slice_peers import SliceExecutors
from lamina.services.model.slice_server import SliceServer, slice_tensors
from lamina.services.wire import Kind, RunSlice, frame_tag

pytestmark = pytest.mark.timeout(120)


def test_the_executor_idle_longest_runs_the_next_slice():
    assert pick_executor([LOCAL, 1, 2], {}) == LOCAL  # none used yet: the coordinator first
    assert pick_executor([LOCAL, 1, 2], {LOCAL: 3, 1: 1, 2: 2}) == 1
    assert pick_executor([2, 1], {1: 5}) == 2  # never used before one that was


def test_sequences_join_the_worker_that_already_holds_most():
    assert coordinator([0, 0]) == 0
    assert coordinator([0, 7, 3]) == 1
    assert coordinator([4, 4]) == 0


class DensePool:
    """Stands in for AttentionPool: attention over the step's rows, after a yield to the
    event loop (as awaiting replies does), so micro-batches interleave."""

    def route(self, seqs):
        return None

    def attend_here(self, route, device=None):
        return None  # no core in this process: every layer awaits its reply

    async def attend(self, tag, layer, route, q, k, v):
        await asyncio.sleep(0)
        return attention_with_lse(q, k, v)[0]


@pytest.fixture(scope="module")
def slices(loaded_model):
    return ModelSlices(loaded_model)


def _batch(tokens: tuple[int, int, int] = (17, 402, 9)) -> tuple[StepBatch, list[SeqRows]]:
    ids = ["a", "b", "c"]
    return StepBatch.build(ids, [[t] for t in tokens], [5, 11, 3]), [SeqRows(s, 1, (0,)) for s in ids]


async def _peer(server: SliceServer) -> tuple[transports.Listener, SliceExecutors]:
    listener = await transports.listen("tcp://127.0.0.1:0", server.serve_connection)

    async def lookup():
        return {1: listener.address}

    return listener, lookup


async def _three_micro_batches_as_one(slices, ex) -> None:
    """Three micro-batches at once over the executors (N = M + 1 with two workers) give
    the logits of the coordinator running the batch alone, bit for bit."""
    batch, rows = _batch()
    pool = DensePool()
    alone = await slices.forward(0, 1, batch, rows, pool)
    outs = await asyncio.gather(*(slices.forward(mb, 1, batch, rows, pool, ex) for mb in range(3)))
    for out in outs:
        assert torch.equal(out, alone)


async def test_slices_run_on_a_peer_give_the_coordinators_logits(slices):
    server = SliceServer(slices.split.slices, slices.run_slice)
    listener, lookup = await _peer(server)
    ex = SliceExecutors(slices.split.slices, slices.run_slice, lookup, transports.TransportConfig(), 10.0,
                        num_workers=2)
    try:
        await ex.refresh()
        assert ex.peers == [1]
        await _three_micro_batches_as_one(slices, ex)
        assert ex.remote_slices == server.frames > 0
        assert ex.remote_slices < 3 * len(slices.split.slices)  # the coordinator ran some itself
        assert ex.fallbacks == 0
    finally:
        await ex.close()
        await listener.close()


class FailingAfter(SliceServer):
    """A peer that answers `good` frames, then fails every slice (or stays silent)."""

    def __init__(self, slices, run, good: int, silent: bool) -> None:
        super().__init__(slices, run)
        self.good, self.silent, self.seen = good, silent, 0

    async def serve_connection(self, conn):
        while True:
            try:
                frame = await conn.recv()
            except transports.TransportError:
                return
            self.seen += 1
            if self.seen > self.good and self.silent:
                continue  # never answers: the coordinator's deadline passes
            if self.seen > self.good:
                frame.header["slice"] = 10_000  # refused as bad_request
            await conn.send(self.handle(frame))


@pytest.mark.parametrize("silent", [False, True], ids=["errors", "silent"])
async def test_a_failing_peer_is_dropped_and_its_slice_runs_on_the_coordinator(slices, silent):
    server = FailingAfter(slices.split.slices, slices.run_slice, good=3, silent=silent)
    listener, lookup = await _peer(server)
    ex = SliceExecutors(slices.split.slices, slices.run_slice, lookup, transports.TransportConfig(), 0.5,
                        num_workers=2, retry_s=3600)
    try:
        await ex.refresh()
        await _three_micro_batches_as_one(slices, ex)
        assert ex.fallbacks == 1 and ex.remote_slices == 3
        assert ex.peers == []  # dropped; found again by a later refresh
    finally:
        await ex.close()
        await listener.close()


def _frame(slices, j: int, **change):
    batch, _ = _batch()
    sl = slices.split.slices[j]
    inputs = batch.model_inputs()
    attn = torch.zeros(3, slices.cfg.num_heads, slices.cfg.head_dim) if sl.takes_attention else None
    context = [torch.zeros(3, slices.cfg.hidden_size) for _ in sl.context_in]
    tensors = slice_tensors(sl, inputs, attn, context)
    for i, t in change.get("tensors", {}).items():
        tensors[i] = t
    return RunSlice((0, 1, j), change.get("slice", j), tensors).to_frame()


@pytest.mark.parametrize("case", ["slice_range", "count", "dtype", "rows", "kind"])
def test_a_frame_that_does_not_fit_the_model_gets_an_error(slices, case):
    server = SliceServer(slices.split.slices, slices.run_slice)
    n = len(slices.split.slices)
    good = _frame(slices, 1)
    frame = {
        "slice_range": lambda: _frame(slices, 1, slice=n),
        "count": lambda: transports.Frame(kind=Kind.SLICE, header=good.header, tensors=good.tensors[:-1]),
        "dtype": lambda: _frame(slices, 1, tensors={0: torch.zeros(3)}),
        "rows": lambda: _frame(slices, 1, tensors={-1: torch.zeros(4, slices.cfg.hidden_size)}),
        "kind": lambda: transports.Frame(kind=Kind.ATTEND, header=good.header, tensors=[]),
    }[case]()
    reply = server.handle(frame)
    assert reply.kind == Kind.ERROR
    assert reply.header["code"] == ("protocol" if case == "kind" else "bad_request")
    assert frame_tag(reply) == (0, 1, 1)
    served = server.handle(good)  # nothing changed: the next frame is served
    assert served.kind == Kind.SLICE_OUT and len(served.tensors) == 3 + len(slices.split.slices[1].context_out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch finds none here)")
async def test_micro_batches_on_their_own_cuda_streams_give_the_logits_of_one_alone():
    """On a GPU each micro-batch's slices and copies run on a stream of its own and its Q, K,
    V go through pinned buffers reused from layer to layer: three micro-batches at once,
    each with tokens of its own, give each the logits it gives alone, on the device (a
    buffer or stream mixed up between them would not)."""
    on_gpu = ModelSlices.load("random:smollm2-135m", "float32", "cuda", torch.float32)
    batches = [_batch(), _batch((3, 1000, 77)), _batch((250, 8, 4096))]
    pool = DensePool()
    alone = [await on_gpu.forward(0, 1, batch, rows, pool) for batch, rows in batches]
    assert alone[0].device.type == "cuda" and not torch.allclose(alone[0], alone[1])
    outs = await asyncio.gather(*(on_gpu.forward(mb, 1, *batches[mb], pool) for mb in range(3)))
    for out, expected in zip(outs, alone):
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert len(on_gpu.staging._streams) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch finds none here)")
async def test_decode_slices_replayed_as_cuda_graphs_give_the_eager_logits():
    """A decode step of 3 sequences replays each slice's graph of bucket 4 (captured at the
    first step): the same logits as the slices run eagerly, step after step, for two
    micro-batches at once, each with tokens of its own (graphs of the two that shared
    memory would mix them up as they replay at once); a step with a prompt's rows runs
    eagerly."""
    from lamina.model.slice_graphs import SliceGraphs

    on_gpu = ModelSlices.load("random:smollm2-135m", "float32", "cuda", torch.float32)
    batches = [_batch(), _batch((3, 1000, 77))]
    pool = DensePool()
    eager = [await on_gpu.forward(0, 1, batch, rows, pool) for batch, rows in batches]
    assert not torch.allclose(eager[0], eager[1])
    on_gpu.graphs = SliceGraphs(on_gpu.split, on_gpu.device)
    for _ in range(3):
        outs = await asyncio.gather(*(on_gpu.forward(mb, 1, *batches[mb], pool) for mb in range(2)))
        for out, expected in zip(outs, eager):
            torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    slices = len(on_gpu.split.slices)
    assert on_gpu.graphs.captures == 2 * slices and on_gpu.graphs.replays == 3 * 2 * slices
    prompt = StepBatch.build(["p"], [[5, 6, 7]], [0])
    await on_gpu.forward(0, 1, prompt, [SeqRows("p", 3, (0,))], pool)
    assert on_gpu.graphs.replays == 3 * 2 * slices  # not a decode step: eagerly
