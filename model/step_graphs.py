"""The local engine's decode step on a GPU as one CUDA graph: every slice and every
layer's attention over the engine's KV buffers, launched by one replay.

Slice graphs (lamina.model.slice_graphs) leave each layer's attention eager: its launches
(the buffer kernels' write, attention and combine, lamina.model.paged_decode) and the
Python around them. On the H200 measured so far that came to about 200 us a layer of
host time, which kept the engine at 5 to 10 times its bandwidth bound at 1B
(docs/services.md, "On an H200"). Here a decode step is captured whole, once per
(batch bucket, context bucket), the first time a step needs it, and replayed.

What a graph fixes at capture, and how a step fits it:
- Rows: the smallest bucket of slice_graphs.BUCKETS holding the step's B sequences. Rows
  past B are padding: zeros in the rows table (address 0, cap 0: the buffer write stores
  nothing for them, and they see no key); their inputs keep what an earlier step left
  (a valid token at a valid position), and only the first B rows' logits are read.
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
contract: they live until the next step), which may reuse their memory.

`capture=False` runs a graph's body eagerly instead of capturing it, over the same static
tensors: the same arithmetic, where CUDA graphs cannot run (the CPU, its kernels under
Triton's interpreter, in the tests).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lamina.model.paged_decode import BufferRows, attend_buffers, multiprocessors, plan_splits
from lamina.model.slice_graphs import CaptureFailed, bucket_for, capture, end_pool
from lamina.model.splitter import SplitModel

log = logging.getLogger(__name__)

# The smallest context bucket: below it, a split of the kernels' grid would cover fewer
# keys than a block, and each bucket is a capture of its own.
CONTEXT_MIN = 512
# The step table's rows: BufferRows' four (base, cap, pos, visible), then the inputs.
_INPUT_IDS, _POSITIONS = 4, 5


def context_bucket(longest: int) -> int:
    """The keys a graph's splits cover for rows of at most `longest` keys."""
    return max(CONTEXT_MIN, 1 << max(longest - 1, 0).bit_length())


@dataclass
class _StepGraph:
    replay: Callable[[], torch.Tensor]  # runs the step (a graph's replay, or the body itself): logits [bucket, V]
    table: torch.Tensor  # int64 [6, bucket] on the device: the rows table, then the inputs


class StepGraphs:
    """One engine's decode steps as CUDA graphs, on `device` (see the module's docstring).
    `multiprocessors` (default the device's) sizes the attention's splits, as for eager
    steps."""

    def __init__(self, split: SplitModel, device: torch.device, *, capture: bool = True,
                 multiprocessors: int | None = None) -> None:
        self.split = split
        self.device = torch.device(device)
        self.capture = capture
        self._multiprocessors = multiprocessors
        self._graphs: dict[tuple[int, int], _StepGraph] = {}
        self._failed: set[tuple[int, int]] = set()
        self._pool: Any = None
        self._stream: torch.cuda.Stream | None = None
        self._failed_graphs: list[torch.cuda.CUDAGraph] = []  # kept: the allocator may still name them
        self.replays = 0  # steps replayed (the tests' and the benchmark's witness)
        self.captures = 0

    @property
    def failures(self) -> int:
        """(batch bucket, context bucket) pairs whose capture failed: their steps run as before."""
        return len(self._failed)

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
        host = torch.empty(6, bucket, dtype=torch.int64)  # [6, bucket]
        host[:4] = BufferRows.table(buffers, held, query_lens, rows=bucket)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(key, buffers[0])
            if graph is None:
                return None
            self._graphs[key] = graph
        # Padding rows keep the inputs an earlier step left there (valid tokens and positions).
        host[_INPUT_IDS, :rows] = input_ids
        host[_POSITIONS, :rows] = positions
        table = graph.table
        if table.is_cuda:
            table[:, :rows].copy_(host[:, :rows].pin_memory(), non_blocking=True)
            table[:4, rows:].zero_()
        else:
            table[:, :rows] = host[:, :rows]
            table[:4, rows:] = 0
        logits = graph.replay()
        self.replays += 1
        return logits[:rows]

    def _capture(self, key: tuple[int, int], like: torch.Tensor) -> _StepGraph | None:
        """The step for `key`'s rows and keys over buffers like `like` ([layers, 2, cap, Hkv, D])."""
        bucket, keys = key
        hkv = like.shape[3]
        # Plain tensors, filled in place before each replay (run_step runs in inference mode).
        with torch.inference_mode(False):
            table = torch.zeros(6, bucket, dtype=torch.int64, device=self.device)  # [6, bucket]
            inputs = {"input_ids": table[_INPUT_IDS], "positions": table[_POSITIONS],
                      "logits_index": torch.arange(bucket, device=self.device)}  # every row is a sequence's last
        rows = BufferRows.over(table[:4], keys, like.dtype, hkv)
        sms = self._multiprocessors or multiprocessors(self.device)
        splits = plan_splits(bucket, hkv, keys, sms)

        def body() -> torch.Tensor:
            # q: [bucket, Hq, D]; k, v: [bucket, Hkv, D]. New outputs each call: the
            # captured ones are the graph's.
            return self.split.run(inputs, lambda i, q, k, v: attend_buffers(i, q, k, v, rows, splits=splits))

        if not self.capture:
            self.captures += 1
            return _StepGraph(body, table)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            # High priority, as slice_graphs' capture streams: none of the default pool's
            # streams (compute, transports' copies) is handed out as this one.
            self._stream = torch.cuda.Stream(self.device, priority=-1)
        assert self._stream is not None
        try:
            graph, logits = capture(body, self._stream, self._pool)
        except CaptureFailed as failed:
            self._failed.add(key)
            if failed.graph is not None:
                end_pool(self.device, failed.graph, self._pool, self._failed_graphs)
                self._pool = torch.cuda.graph_pool_handle()
            log.warning("the decode step of %d rows over up to %d keys cannot be captured as a CUDA graph (its "
                        "slices replay one by one): %s", bucket, keys, failed.error)
            return None
        self.captures += 1

        def replay() -> torch.Tensor:
            graph.replay()
            return logits  # the captured call's, written again by each replay

        return _StepGraph(replay, table)
