"""Decode slices on a GPU, captured as CUDA graphs and replayed: a model worker's (each
of its micro-batches apart) and the local engine's (one micro-batch, 0).

A decode step of B sequences (one new token each) runs each slice of the split model
(lamina.model.splitter) between two attentions; on a GPU each slice is a few dozen
kernel launches, which at small batches cost more CPU time than the GPU spends on them.
Each (micro-batch, slice, bucket) is captured once, for the smallest bucket of BUCKETS
that holds B rows: at the worker's start where its warm-up captures them (`warm_up_graph_keys`,
lamina.services.warm_up), else the first time a step needs it; a step copies the inputs the slice
reads into the graph's input tensors (the first B rows; the rest keep what they held,
rows no step reads), replays it, and takes the first B rows of its outputs. Every
micro-batch's graphs have tensors of their own: its outputs stay untouched while another
micro-batch replays the same slice. A slice's outputs live until the same micro-batch's
next step starts replaying (its graphs share a pool, below: a later slice's outputs may
sit where an earlier slice's intermediates were), after that step's tokens were
sampled and its attention replies received. A step that is not a decode
step (several new tokens a sequence) or larger than the largest bucket runs eagerly,
as does a slice whose capture failed (logged once).

Graphs are replayed on the thread's current stream: on a model worker the micro-batch's
(services/model/staging.py). The graphs of one (micro-batch, bucket) share a memory pool
for their intermediates: they replay one after another on one stream, in the order they
were captured (slice 0, 1, ...), which is when graphs may share one. Two micro-batches'
graphs never share: they replay at once on their own streams. Nor do they share a
capture stream: cuBLAS keeps a workspace per stream, and a graph keeps the one of the
stream it was captured on, so two micro-batches' products replaying at once would write
one workspace. Captures run without synchronizing the device or emptying the allocator's
caches; a failed capture leaves the thread on the stream it was on, and its memory pool
is not used again (a capture that ended in error may leave the allocator's bookkeeping
of that pool behind).

`capture=False` runs a slice's body eagerly over the same static tensors instead of
replaying a graph: the same copies in and out, where CUDA graphs cannot run (the CPU, in
the tests).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from lamina.model.splitter import CallSlice, SliceOutput, SplitModel

log = logging.getLogger(__name__)

T = TypeVar("T")

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def bucket_for(rows: int) -> int | None:
    """The smallest bucket that holds `rows` rows (None: more than the largest)."""
    return next((b for b in BUCKETS if b >= rows), None)


def buckets_up_to(rows: int) -> tuple[int, ...]:
    """The buckets a step of at most `rows` rows may need (every bucket, past the largest)."""
    largest = bucket_for(rows) or BUCKETS[-1]
    return tuple(b for b in BUCKETS if b <= largest)


@dataclass
class _Graph:
    replay: Callable[[], SliceOutput]  # the graph's replay (or the slice's body, capture=False): `out`
    inputs: dict[str, torch.Tensor]  # the step's inputs, [bucket] each
    attn: torch.Tensor | None  # the attention output the slice takes, [bucket, ...]
    context: list[torch.Tensor]  # the previous slice's context, [bucket, ...] each


class SliceGraphs:
    """The captured decode slices of one model worker on `device`."""

    def __init__(self, split: SplitModel, device: torch.device, *, capture: bool = True) -> None:
        self.split = split
        self.device = device
        self.capture = capture
        self._graphs: dict[tuple[int, int, int], _Graph] = {}
        self._failed: set[tuple[int, int]] = set()  # (slice, bucket) whose capture failed
        self._pools: dict[tuple[int, int], Any] = {}  # by (micro-batch, bucket)
        self._capture_streams: dict[int, torch.cuda.Stream] = {}  # by micro-batch
        self._failed_graphs: list[torch.cuda.CUDAGraph] = []  # kept: the allocator may still name them
        self.replays = 0  # slices replayed (lamina_model_graph_replays and the tests' witness)
        self.captures = 0

    @property
    def failures(self) -> int:
        """(slice, bucket) pairs whose capture failed and that run eagerly."""
        return len(self._failed)

    def caller(self, micro_batch: int) -> CallSlice:
        """SplitModel.run's `call_slice` for one micro-batch: slice j by its graph where
        one serves the step, else eagerly (grad mode is the caller's)."""
        def call_slice(j: int, inputs: dict[str, Any], attn: torch.Tensor | None,
                       context: Sequence[torch.Tensor]) -> SliceOutput:
            return self.run(micro_batch, j, inputs, attn, context) or self.split.slices[j](inputs, attn, context)

        return call_slice

    def run(self, micro_batch: int, j: int, inputs: dict[str, Any], attn: torch.Tensor | None,
            context: Sequence[torch.Tensor]) -> SliceOutput | None:
        """Slice j of a decode step by its graph (None: the caller runs it eagerly)."""
        rows = inputs["input_ids"].shape[0]
        bucket = bucket_for(rows)
        if bucket is None or inputs["logits_index"].shape[0] != rows or (j, bucket) in self._failed:
            return None  # not a decode step (a prompt's rows), or too large
        # The model inputs this slice reads (no flags): each step copies only these in.
        inputs = {name: inputs[name] for name in self.split.slices[j].graph_inputs
                  if isinstance(inputs[name], torch.Tensor)}
        key = (micro_batch, j, bucket)
        g = self._graphs.get(key)
        if g is None:
            g = self._capture(micro_batch, j, bucket, inputs, attn, context)
            if g is None:
                return None
            self._graphs[key] = g
        for name, t in inputs.items():
            g.inputs[name][:rows].copy_(t, non_blocking=True)
        if g.attn is not None and attn is not None:
            g.attn[:rows].copy_(attn, non_blocking=True)
        for static, t in zip(g.context, context):
            static[:rows].copy_(t, non_blocking=True)
        out = g.replay()
        self.replays += 1
        return SliceOutput(None if out.qkv is None else tuple(t[:rows] for t in out.qkv),  # type: ignore[arg-type]
                           [c[:rows] for c in out.context],
                           out.output[:rows] if isinstance(out.output, torch.Tensor) else out.output)

    def _capture(self, micro_batch: int, j: int, bucket: int, inputs: dict[str, Any], attn: torch.Tensor | None,
                 context: Sequence[torch.Tensor]) -> _Graph | None:
        """Slice j captured for `bucket` rows, its tensors shaped and typed as this step's."""
        def static(t: torch.Tensor) -> torch.Tensor:
            return torch.zeros((bucket, *t.shape[1:]), dtype=t.dtype, device=self.device)

        # Plain tensors even where the caller is in inference mode (the colocated step): a
        # graph replayed later outside it copies its inputs into them in place.
        with torch.inference_mode(False):
            g_inputs = {name: static(t) for name, t in inputs.items()}
            g_attn = None if attn is None else static(attn)
            g_context = [static(t) for t in context]
        if "logits_index" in g_inputs:  # the last slice's: every row of a bucket is a sequence's
            g_inputs["logits_index"].copy_(torch.arange(bucket, device=self.device))  # last token
        slice_j = self.split.slices[j]
        if not self.capture:
            def body() -> SliceOutput:
                with torch.inference_mode():
                    return slice_j(g_inputs, g_attn, g_context)

            self.captures += 1
            return _Graph(body, g_inputs, g_attn, g_context)
        pool = self._pools.get((micro_batch, bucket))
        if pool is None:
            pool = self._pools[(micro_batch, bucket)] = torch.cuda.graph_pool_handle()
        cap = self._capture_streams.get(micro_batch)
        if cap is None:
            # From the high-priority pool: torch hands out each priority's 32 streams round
            # robin, and the default pool's serve every micro-batch's compute stream and the
            # transports' copy streams, so after 32 of those (reconnects) one could be another
            # micro-batch's capture stream again, its cuBLAS workspace shared. Only capture
            # streams come from this pool (a replay runs at the priority of its own stream).
            cap = self._capture_streams[micro_batch] = torch.cuda.Stream(self.device, priority=-1)
        try:
            graph, out = capture(lambda: slice_j(g_inputs, g_attn, g_context), cap, pool)
        except CaptureFailed as failed:
            self._failed.add((j, bucket))
            if failed.graph is not None:
                self._abandon(micro_batch, bucket, failed.graph, pool)
            log.warning("slice %d at batch %d cannot be captured as a CUDA graph (it runs eagerly): %s", j, bucket,
                        failed.error, exc_info=failed.error)
            return None
        self.captures += 1

        def replay() -> SliceOutput:
            graph.replay()
            return out  # the slice's outputs, [bucket, ...] each, written again by each replay

        return _Graph(replay, g_inputs, g_attn, g_context)

    def _abandon(self, micro_batch: int, bucket: int, graph: torch.cuda.CUDAGraph, pool: Any) -> None:
        """After a capture that failed once begun: the graph kept and the pool ended
        (`end_pool`), and the (micro-batch, bucket) takes a new pool for later captures."""
        end_pool(self.device, graph, pool, self._failed_graphs)
        self._pools.pop((micro_batch, bucket), None)


class CaptureFailed(RuntimeError):
    """A capture that raised: `graph` is the graph begun (None: it failed before), `error` why
    (logged with its traceback where the graphs fall back to eager: an error not CUDA's is
    likely a bug of the captured code, which the eager run then meets again)."""

    def __init__(self, graph: torch.cuda.CUDAGraph | None, error: Exception) -> None:
        super().__init__(str(error))
        self.graph, self.error = graph, error


def capture(fn: Callable[[], T], stream: torch.cuda.Stream, pool: Any) -> tuple[torch.cuda.CUDAGraph, T]:
    """fn's launches captured as a CUDA graph on `stream` into the memory pool `pool`,
    after two eager calls there (lazy initialisation, a first call's compiles, must not
    be captured), with (graph, what the captured call returned) returned. The current
    stream waits for them (what fn read was written there; what the warm-up wrote, the
    replays use). capture_begin/end, not torch.cuda.graph: that one synchronizes the
    device and empties the allocator's caches at every capture, mid-decode. Errors only
    for this thread's unsafe calls: other streams' work stays queued. A failure raises
    CaptureFailed and leaves the thread on the stream it was on."""
    current = torch.cuda.current_stream(stream.device)
    graph = None
    try:
        stream.wait_stream(current)
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):
                fn()
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                out = fn()
            finally:
                graph.capture_end()
    except Exception as exc:  # CUDA's errors, and any other a warm-up call raises (a Triton compile's)
        with contextlib.suppress(RuntimeError):  # the warm-up's reads of the static tensors, before they are freed
            current.wait_stream(stream)
        raise CaptureFailed(graph, exc) from exc
    current.wait_stream(stream)
    return graph, out


class CapturePool:
    """One memory pool that a family of graphs (lamina.model.step_graphs',
    lamina.model.attend_graphs') is captured into, on a high-priority stream of its own
    (see SliceGraphs._capture: none of the default pool's streams is handed out as it). A
    capture that fails once begun ends the pool (`end_pool`) and the next one starts a new
    one; the failed graphs are kept, since the allocator may still name them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool: Any = None
        self._stream: torch.cuda.Stream | None = None
        self._failed_graphs: list[torch.cuda.CUDAGraph] = []

    def capture(self, fn: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
        """`capture(fn, ...)` into this pool: (graph, what the captured call returned), or CaptureFailed."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.device, priority=-1)
        assert self._stream is not None
        try:
            return capture(fn, self._stream, self._pool)
        except CaptureFailed as failed:
            if failed.graph is not None:
                end_pool(self.device, failed.graph, self._pool, self._failed_graphs)
                self._pool = torch.cuda.graph_pool_handle()
            raise

    def replayer(self, fn: Callable[[], T]) -> Callable[[], T]:
        """fn captured (`capture`): a call that replays its graph and returns what the
        captured call returned, which each replay writes again."""
        graph, out = self.capture(fn)

        def replay() -> T:
            graph.replay()
            return out

        return replay


def end_pool(device: torch.device, graph: torch.cuda.CUDAGraph, pool: Any, keep: list) -> None:
    """After a capture that failed once begun: the allocator is told the capture into
    `pool` is over (where the failed end of capture did not get that far, every block
    freed with a pending use on another stream would be held back for good), and the
    graph is kept in `keep` (the allocator may still refer to it). The pool is not used again."""
    keep.append(graph)
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is not None:
        with contextlib.suppress(RuntimeError):  # the capture's end had told it already
            end(device.index if device.index is not None else torch.cuda.current_device(), pool)
