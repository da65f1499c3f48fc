"""An attention worker's decode attention on a GPU as CUDA graphs: a layer of a
micro-batch's step, one replay.

Eagerly, each ATTEND frame's attention costs its launches on the host: the new K, V rows'
writes into the slab pools, the paged kernel and the splits' combine (Triton kernels
launched from Python), and the Python around them. On the H200 measured so far a layer of
the attention worker's core took about 310 us whatever its KV, of which the same calls'
Python takes 28 us on this project's CPU host (docs/services.md, "On an H200"), and the
disaggregated stack pays it once a layer and micro-batch. Here `attend_slab`
(lamina.model.paged_decode: the rows' writes in one launch, then the paged kernel and its
combine) is captured once per (layer, batch bucket, context bucket), and replayed: at the
worker's start where its warm-up captures them (`prepare`, lamina.services.warm_up), else
the first time a frame needs it.

What a graph reads, static per (batch bucket, context bucket) and shared by the layers'
graphs: the rows table (SlabRows: each row's start in the page table, its keys, its new
slot; padding rows write nothing and see no key), the page table (int32, bucket x keys
entries) and Q, K, V of `bucket` rows. A micro-batch's tables are made once a step
(`tables`, on the device) and copied into the static ones when another micro-batch's were
there; each call copies its Q, K, V into the first rows, replays, and returns its rows of
the output as a tensor of their own (the next replay writes the static output again).
Only decode steps are served (one new token a sequence, at most the largest bucket's
sequences, every tensor in the pools' dtype); `serves` and `accepts` say which.

Each micro-batch's calls run one at a time on the thread's current stream (the core is
called from one thread), so a replay never overlaps another's use of the static tensors.
All graphs share one memory pool. `capture=False` runs a graph's body eagerly over the
same static tensors: the same arithmetic, where CUDA graphs cannot run (the CPU, its
kernels under Triton's interpreter, in the tests). A failed capture is logged and its
key's calls run the body eagerly from then on.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lamina.model.paged_decode import SlabRows, attend_slab, multiprocessors, plan_splits
from lamina.model.slice_graphs import CaptureFailed, CapturePool, bucket_for
from lamina.model.step_graphs import context_bucket
from lamina.model.uploads import upload

log = logging.getLogger(__name__)

_TOKENS = itertools.count()  # tells one micro-batch's step tables from another's


@dataclass(frozen=True)
class StepTables:
    """A micro-batch step's rows and page table on the pools' device, made once a step."""

    key: tuple[int, int]  # (batch bucket, context bucket)
    rows: int  # the step's sequences (the rows a call fills)
    table: torch.Tensor  # int64 [3, bucket]: SlabRows' start, visible, new
    slots: torch.Tensor  # int32 [N]: every sequence's slots, in order
    token: int  # these tables' identity


@dataclass
class _Statics:
    """What the graphs of one (batch bucket, context bucket) read and write."""

    table: torch.Tensor  # int64 [3, bucket]
    slots: torch.Tensor  # int32 [bucket * keys]
    q: torch.Tensor  # [bucket, Hq, D]
    k: torch.Tensor  # [bucket, Hkv, D]
    v: torch.Tensor  # [bucket, Hkv, D]
    out: torch.Tensor  # [bucket, Hq, D]: every layer's output, written again by each replay
    rows: SlabRows
    splits: int
    holds: int = -1  # the token of the step tables copied in last


class AttendGraphs:
    """Decode attention over the slab pools (`k_pools`, `v_pools`: one [S, Hkv, D] tensor
    a layer, allocated once) of queries with `num_q_heads` heads, as CUDA graphs (see the
    module's docstring). `multiprocessors` (default the device's) sizes the splits."""

    def __init__(self, k_pools: Sequence[torch.Tensor], v_pools: Sequence[torch.Tensor], num_q_heads: int, *,
                 capture: bool = True, multiprocessors: int | None = None) -> None:
        self.k_pools, self.v_pools = list(k_pools), list(v_pools)
        self.device = self.k_pools[0].device
        self.dtype = self.k_pools[0].dtype
        self.num_q_heads = num_q_heads
        self.capture = capture
        self._multiprocessors = multiprocessors
        self._statics: dict[tuple[int, int], _Statics] = {}
        self._graphs: dict[tuple[int, int, int], Callable[[], torch.Tensor]] = {}  # (layer, bucket, keys)
        self._failed: set[tuple[int, int, int]] = set()
        self._pool = CapturePool(self.device)
        self.replays = 0  # calls served by a graph's replay (or, capture=False, by its body)
        self.captures = 0

    @property
    def failures(self) -> int:
        """(layer, batch bucket, context bucket) keys whose capture failed."""
        return len(self._failed)

    @staticmethod
    def serves(query_lens: Sequence[int]) -> bool:
        """Whether a graph serves a step of sequences with these new tokens."""
        return bool(query_lens) and bucket_for(len(query_lens)) is not None and all(n == 1 for n in query_lens)

    def accepts(self, *tensors: torch.Tensor) -> bool:
        """Whether Q, K, V come in the pools' dtype (others take the eager path, which
        attends them in theirs)."""
        return all(t.dtype == self.dtype for t in tensors)

    def tables(self, lens: Sequence[int], slots: torch.Tensor, device_slots: torch.Tensor) -> StepTables:
        """A step's tables (a step `serves`): sequences of `lens` keys, each extended by its
        new token already, whose slots are `slots` (int64 [sum(lens)], in order, the CPU)
        and `device_slots` (the same as int32 on the pools' device)."""
        rows = len(lens)
        bucket = bucket_for(rows)
        if bucket is None:
            raise ValueError(f"no graph serves a step of {rows} sequences")
        table = upload(SlabRows.table(lens, slots, rows=bucket), self.device)  # [3, bucket]
        return StepTables((bucket, context_bucket(max(lens))), rows, table, device_slots, next(_TOKENS))

    def attend(self, layer: int, tables: StepTables, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """The step's new K, V [B, Hkv, D] written into their slots of layer `layer`'s pools
        and attention of q [B, Hq, D] over each sequence: out [B, Hq, D] in the pools'
        dtype, on their device (q, k, v: in that dtype, on any device)."""
        st = self._statics.get(tables.key)
        if st is None:
            st = self._statics[tables.key] = self._make_statics(tables.key)
        if st.holds != tables.token:
            st.table.copy_(tables.table)
            st.slots[:tables.slots.numel()].copy_(tables.slots)
            st.holds = tables.token
        b = tables.rows
        st.q[:b].copy_(q)
        st.k[:b].copy_(k)
        st.v[:b].copy_(v)
        key = (layer, *tables.key)
        run = self._graphs.get(key)
        if run is None:
            run = self._graphs[key] = self._capture(key, st)
        out = run()
        self.replays += key not in self._failed
        return out[:b].clone()

    def prepare(self, layers: int, buckets: Sequence[int], contexts: Sequence[int]) -> int:
        """Every (layer, batch bucket, context bucket) of these captured now, before any
        frame needs it (a worker's start), and replayed once: the statics' padding rows
        write nothing into the pools and attend over no key. With capture=False each body
        runs once, as a capture's own first calls do. Returns the graphs made. An error
        (out of memory) is raised with the graphs made before it kept and its key left to
        the first frame that needs it."""
        made = 0
        for key in itertools.product(buckets, contexts):
            st = self._statics.get(key)
            if st is None:
                st = self._statics[key] = self._make_statics(key)
            for layer in range(layers):
                if (layer, *key) not in self._graphs:
                    try:
                        run = self._graphs[(layer, *key)] = self._capture((layer, *key), st)
                        run()
                    except BaseException:
                        self._graphs.pop((layer, *key), None)
                        raise
                    made += 1
        return made

    def _make_statics(self, key: tuple[int, int]) -> _Statics:
        bucket, keys = key
        hkv, d = self.k_pools[0].shape[1:]
        with torch.inference_mode(False):
            table = torch.zeros(3, bucket, dtype=torch.int64, device=self.device)  # [3, bucket]
            table[2] = -1  # every row padding until a step fills it
            slots = torch.zeros(bucket * keys, dtype=torch.int32, device=self.device)  # [bucket * keys]
            q = torch.zeros(bucket, self.num_q_heads, d, dtype=self.dtype, device=self.device)  # [bucket, Hq, D]
            k = torch.zeros(bucket, hkv, d, dtype=self.dtype, device=self.device)  # [bucket, Hkv, D]
            v = torch.zeros_like(k)
            out = torch.zeros_like(q)
        splits = plan_splits(bucket, hkv, keys, self._multiprocessors or multiprocessors(self.device))
        return _Statics(table, slots, q, k, v, out, SlabRows.over(table, slots, keys), splits)

    def _capture(self, key: tuple[int, int, int], st: _Statics) -> Callable[[], torch.Tensor]:
        """The replay of `key`'s graph, or its body where capture is off or failed."""
        layer = key[0]

        def body() -> torch.Tensor:
            # Copied into the statics' one output, made outside the pool: the graph's own
            # output is then an intermediate, which later captures reuse, so the graphs of
            # one key hold one [bucket, Hq, D] between every layer (each call's rows are
            # cloned before the next replay).
            return st.out.copy_(attend_slab(self.k_pools[layer], self.v_pools[layer], st.q, st.k, st.v, st.rows,
                                            splits=st.splits))  # [bucket, Hq, D]

        if not self.capture:
            self.captures += 1
            return body
        try:
            replay = self._pool.replayer(body)
        except CaptureFailed as failed:
            self._failed.add(key)
            log.warning("layer %d's decode attention of %d rows over up to %d keys cannot be captured as a CUDA "
                        "graph (it runs eagerly): %s", *key, failed.error, exc_info=failed.error)
            return body
        self.captures += 1
        return replay
