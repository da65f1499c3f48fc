"""A decode step on a GPU as one CUDA graph: every slice and every layer's attention,
launched by one replay. `StepGraphs` serves the local engine, attending over its
per-sequence KV buffers (lamina.model.paged_decode's buffer kernels); `SlabStepGraphs` a
colocated model worker, attending over its attention core's slab pools (the paged
kernel, `attend_slab`). Both are keyed, filled and replayed alike; below, the engine's.

Slice graphs (lamina.model.slice_graphs) leave each layer's attention eager: its launches
(the buffer kernels' write, attention and combine, lamina.model.paged_decode) and the
Python around them. On the H200 measured so far that came to about 200 us a layer of
host time, which kept the engine at 5 to 10 times its bandwidth bound at 1B
(docs/services.md, "On an H200"). Here a decode step is captured whole, once per
(batch bucket, context bucket), and replayed: the engine's the first time a step needs
it, a colocated worker's at its start where its warm-up captures them (`prepare`,
lamina.services.warm_up), else also at a step's first need.

What a graph fixes at capture, and how a step fits it:
- Rows: the smallest bucket of slice_graphs.BUCKETS holding the step's B sequences. Rows
  past B are padding: zeros in the rows table (address 0, cap 0: the buffer write stores
  nothing for them, and they see no key); their inputs are token 0 at position 0, and
  only the first B rows' logits are read.
- Keys: the attention kernels' grid, and so how many keys each split covers, is fixed,
  for rows of at most the context bucket's keys (the smallest power of two of at least
  CONTEXT_MIN holding the step's longest row); a split that starts past its row's keys
  ends at once.
- Addresses: each row's sequence buffer (address and cap) and write position are read
  from the rows table on the device, which each step fills before the replay, with the
  step's token ids and positions, in one copy: a buffer that grew
  (SequenceKV.reserve) is read at its new place.

Only steps where every sequence has one new token, of at most the largest bucket's
sequences, are replayed; the others (prompts, larger batches) run as before. All graphs
of one engine share one memory pool: they replay one at a time on the thread's current
stream, and a step's logits are sampled before the next step replays (run_step's
contract: they live until the next step), which may reuse their memory: the graphs of
one batch bucket write their logits into one output tensor of that bucket.

`capture=False` runs a graph's body eagerly instead of capturing it, over the same static
tensors: the same arithmetic, where CUDA graphs cannot run (the CPU, its kernels under
Triton's interpreter, in the tests).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lamina.model.paged_decode import (
    BufferRows,
    SlabRows,
    attend_buffers,
    attend_slab,
    multiprocessors,
    plan_splits,
)
from lamina.model.slice_graphs import CaptureFailed, CapturePool, bucket_for
from lamina.model.splitter import SplitModel

log = logging.getLogger(__name__)

# The smallest context bucket: below it, a split of the kernels' grid would cover fewer
# keys than a block, and each bucket is a capture of its own.
CONTEXT_MIN = 512


def context_bucket(longest: int) -> int:
    """The keys a graph's splits cover for rows of at most `longest` keys."""
    return max(CONTEXT_MIN, 1 << max(longest - 1, 0).bit_length())


def context_buckets_up_to(keys: int) -> tuple[int, ...]:
    """The context buckets of rows of at most `keys` keys, smallest first."""
    largest, buckets = context_bucket(keys), [CONTEXT_MIN]
    while buckets[-1] < largest:
        buckets.append(buckets[-1] * 2)
    return tuple(buckets)


@dataclass
class _StepGraph:
    replay: Callable[[], torch.Tensor]  # runs the step (a graph's replay, or the body itself): logits [bucket, V]
    table: torch.Tensor  # int64 [rows, bucket] on the device: the attention's rows, then the inputs
    slots: torch.Tensor | None = None  # int32 [bucket * keys]: the slab's page table (SlabStepGraphs)


class _Graphs:
    """What both kinds of step graph share: the graphs by (batch bucket, context bucket),
    their capture into one pool on a stream of their own, and the counts."""

    def __init__(self, split: SplitModel, device: torch.device, capture: bool, multiprocessors: int | None) -> None:
        self.split = split
        self.device = torch.device(device)
        self.capture = capture
        self._multiprocessors = multiprocessors
        self._graphs: dict[tuple[int, int], _StepGraph] = {}
        self._failed: set[tuple[int, int]] = set()
        self._pool = CapturePool(self.device)
        self._outputs: dict[int, torch.Tensor] = {}  # by batch bucket: logits [bucket, V], every replay's
        self.replays = 0  # steps replayed (the tests', the metrics' and the benchmark's witness)
        self.captures = 0

    @property
    def failures(self) -> int:
        """(batch bucket, context bucket) pairs whose capture failed."""
        return len(self._failed)

    def splits(self, bucket: int, keys: int, kv_heads: int) -> int:
        """The attention's splits a row for a graph of `bucket` rows over up to `keys` keys."""
        return plan_splits(bucket, kv_heads, keys, self._multiprocessors or multiprocessors(self.device))

    def _graph(self, key: tuple[int, int], body: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor] | None:
        """The step's replay for `key`: `body` captured (or run as it is, capture=False),
        its logits in the batch bucket's output; None where the capture failed (logged;
        the key is failed for good)."""
        bucket = key[0]

        def into_output() -> torch.Tensor:
            # The logits copied into the bucket's one output, made outside the pool by the
            # first warm-up: the graph's own logits are then intermediates, which the
            # other graphs reuse, so the graphs of one bucket hold one [bucket, V] between
            # them however many context buckets a run meets (128k-token vocabularies make
            # 0.5 MB a row).
            logits = body()
            out = self._outputs.get(bucket)
            if out is None:
                out = self._outputs[bucket] = torch.empty_like(logits)
            return out.copy_(logits)

        if not self.capture:
            self.captures += 1
            return into_output
        try:
            replay = self._pool.replayer(into_output)  # returns the bucket's output, written again by each replay
        except CaptureFailed as failed:
            self._failed.add(key)
            log.warning("the decode step of %d rows over up to %d keys cannot be captured as a CUDA graph: %s",
                        *key, failed.error, exc_info=failed.error)
            return None
        self.captures += 1
        return replay

    def _inputs(self, table: torch.Tensor, bucket: int) -> dict[str, torch.Tensor]:
        """The slices' inputs as rows of the step's table (its last two: token ids,
        positions); every row is a sequence's last token."""
        return {"input_ids": table[-2], "positions": table[-1],
                "logits_index": torch.arange(bucket, device=self.device)}

    def _replay(self, graph: _StepGraph, host: torch.Tensor, rows: int, input_ids: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        """Fills the graph's table from `host` (the attention's rows, padding included,
        then the inputs: the step's tokens in its first `rows` columns, token 0 at position
        0 in the padding's) in one copy, and replays: logits [rows, V]."""
        host[-2, :rows] = input_ids
        host[-1, :rows] = positions
        if graph.table.is_cuda:
            graph.table.copy_(host.pin_memory(), non_blocking=True)
        else:
            graph.table.copy_(host)
        logits = graph.replay()
        self.replays += 1
        return logits[:rows]


class StepGraphs(_Graphs):
    """The local engine's decode steps as CUDA graphs, on `device` (see the module's
    docstring). `multiprocessors` (default the device's) sizes the attention's splits,
    as for eager steps."""

    def __init__(self, split: SplitModel, device: torch.device, *, capture: bool = True,
                 multiprocessors: int | None = None) -> None:
        super().__init__(split, device, capture, multiprocessors)

    def run(self, buffers: Sequence[torch.Tensor], held: Sequence[int], query_lens: Sequence[int],
            input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """A decode step's logits [B, V] float32, its new K, V written into the buffers
        (each sequence's, holding `held` tokens; input_ids, positions: [B] on the CPU), or
        None where no graph serves it (the caller runs it as before)."""
        rows = len(query_lens)
        bucket = bucket_for(rows)
        if bucket is None or any(n != 1 for n in query_lens) or not buffers:
            return None
        key = (bucket, context_bucket(max(held) + 1))
        if key in self._failed:
            return None
        host = torch.zeros(6, bucket, dtype=torch.int64)  # [6, bucket]: BufferRows' four, then the inputs
        host[:4] = BufferRows.table(buffers, held, query_lens, rows=bucket)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(key, buffers[0])
            if graph is None:
                return None
            self._graphs[key] = graph
        return self._replay(graph, host, rows, input_ids, positions)

    def _capture(self, key: tuple[int, int], like: torch.Tensor) -> _StepGraph | None:
        """The step for `key`'s rows and keys over buffers like `like` ([layers, 2, cap, Hkv, D])."""
        bucket, keys = key
        hkv = like.shape[3]
        # Plain tensors, filled in place before each replay (run_step runs in inference mode).
        with torch.inference_mode(False):
            table = torch.zeros(6, bucket, dtype=torch.int64, device=self.device)  # [6, bucket]
            inputs = self._inputs(table, bucket)
        rows = BufferRows.over(table[:4], keys, like.dtype, hkv)
        splits = self.splits(bucket, keys, hkv)

        def body() -> torch.Tensor:
            # q: [bucket, Hq, D]; k, v: [bucket, Hkv, D]. New outputs each call: the
            # captured ones are the graph's.
            return self.split.run(inputs, lambda i, q, k, v: attend_buffers(i, q, k, v, rows, splits=splits))

        replay = self._graph(key, body)
        return None if replay is None else _StepGraph(replay, table)


class SlabStepGraphs(_Graphs):
    """A colocated model worker's decode steps as CUDA graphs, attending over its
    attention core's slab pools (`k_pools`, `v_pools`: one [S, Hkv, D] tensor a layer,
    allocated once; lamina.kvstore.slab) by the paged kernel (lamina.model.paged_decode's
    attend_slab): the same graphs as StepGraphs', whose rows table holds each row's start
    in the step's page table, its keys and its new slot, and whose page table (the step's
    slots, int32) is copied in beside it. Where a capture fails, its steps run the same
    body eagerly: the caller has already extended the sequences for the step."""

    def __init__(self, split: SplitModel, k_pools: Sequence[torch.Tensor], v_pools: Sequence[torch.Tensor], *,
                 capture: bool = True, multiprocessors: int | None = None) -> None:
        super().__init__(split, k_pools[0].device, capture, multiprocessors)
        self.k_pools, self.v_pools = list(k_pools), list(v_pools)

    @staticmethod
    def serves(query_lens: Sequence[int]) -> bool:
        """Whether a graph serves a step of sequences with these new tokens."""
        return bool(query_lens) and bucket_for(len(query_lens)) is not None and all(n == 1 for n in query_lens)

    def run(self, lens: Sequence[int], slots: torch.Tensor, input_ids: torch.Tensor,
            positions: torch.Tensor) -> torch.Tensor:
        """A decode step's logits [B, V] float32 (a step `serves`): sequences of `lens` keys,
        each extended by its new token already, whose slots are `slots` (int64 [sum(lens)],
        in order, the CPU); input_ids, positions: [B] on the CPU."""
        rows = len(lens)
        bucket = bucket_for(rows)
        if bucket is None:
            raise ValueError(f"no graph serves a step of {rows} sequences")
        key = (bucket, context_bucket(max(lens)))
        host = torch.zeros(5, bucket, dtype=torch.int64)  # [5, bucket]: SlabRows' three, then the inputs
        host[:3] = SlabRows.table(lens, slots, rows=bucket)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(key)
        assert graph.slots is not None
        n = slots.numel()
        if graph.slots.is_cuda:
            graph.slots[:n].copy_(slots.to(torch.int32).pin_memory(), non_blocking=True)
        else:
            graph.slots[:n] = slots
        return self._replay(graph, host, rows, input_ids, positions)

    def prepare(self, buckets: Sequence[int], contexts: Sequence[int]) -> int:
        """Every (batch bucket, context bucket) of these captured now, before any step
        needs it (a worker's start), and replayed once: its padding rows write nothing
        into the pools and attend over no key. With capture=False each body runs once, as
        a capture's own first calls do. Returns the graphs made. An error (out of memory)
        is raised with the graphs made before it kept and its key left to the first
        step that needs it."""
        made = 0
        for key in itertools.product(buckets, contexts):
            if key not in self._graphs:
                try:
                    graph = self._graphs[key] = self._capture(key)
                    graph.replay()
                except BaseException:
                    self._graphs.pop(key, None)
                    raise
                made += 1
        return made

    def _capture(self, key: tuple[int, int]) -> _StepGraph:
        bucket, keys = key
        pool = self.k_pools[0]
        hkv = pool.shape[1]
        with torch.inference_mode(False):
            table = torch.zeros(5, bucket, dtype=torch.int64, device=self.device)  # [5, bucket]
            table[2] = -1  # every row padding until a step fills it
            slots = torch.zeros(bucket * keys, dtype=torch.int32, device=self.device)  # [bucket * keys]
            inputs = self._inputs(table, bucket)
        rows = SlabRows.over(table[:3], slots, keys)
        splits = self.splits(bucket, keys, hkv)

        def body() -> torch.Tensor:
            # q: [bucket, Hq, D]; k, v: [bucket, Hkv, D].
            return self.split.run(inputs, lambda i, q, k, v: attend_slab(self.k_pools[i], self.v_pools[i], q, k, v,
                                                                         rows, splits=splits))

        return _StepGraph(self._graph(key, body) or body, table, slots)
