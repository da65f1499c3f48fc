"""The attention worker's state and arithmetic, without I/O.

Holds each sequence's K and V for the KV heads this worker owns in the
token-granular slab allocator (lamina.kvstore.slab), and computes attention for the
rows it is sent: per frame, the new tokens' K and V go into the pools in one
indexed write each, and one call of the batched kernel (lamina.model.kv_attention)
attends every sequence of the frame, reading the pools in place. The slots a
micro-batch reads are concatenated once per step and kept while its sequences'
slots do not change; over float32 CPU pools, the decode path (no lse: a model worker's
frames) is addressed once per step too (lamina.model.kv_attention.SlotStep), so each
layer takes one native write of the new rows and one kernel call. The service wraps it
in a transport listener and a gRPC control server.

With `kv_quant="q4"` the pools hold 4-bit packed rows (lamina.model.kv_quant: codes and a
float16 min and scale per group of a token's head) instead of float32: every K and V
that arrives (a step's new tokens, a prefill's STORE_KV) is quantized once as it is
written, and the kernel decodes the rows block by block as it attends. Everything
this worker answers is computed from the packed rows, the new tokens' own K and V
included, so the plain and the Q-early paths see the same keys and values.

Several micro-batches interleave their layers on one worker, each with its own
sequences; nothing here tracks a step in progress except through the sequences
themselves (their lengths and slot versions), so any interleaving is served.

What must hold: a sequence is decoded only after its prompt KV arrived whole
(STORE_KV up to the last layer); a decode step extends every sequence by its new
tokens at layer 0 and writes them in every layer before the step's last frame.
If a step dies midway the scheduler frees its sequences, so no half-written
token is ever read by a later step. Every entry point first checks its message
(lamina.services.attention.attention_checks) and refuses, before any state changes, one that would
break these rules or does not fit the model's shape.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import accumulate, chain
from time import monotonic

import torch

from lamina.kvstore.slab import KVAllocationError, SlabAllocator, SlabConfig
from lamina.model.attend_graphs import AttendGraphs, StepTables
from lamina.model.attention import combine_partials
from lamina.model.config import ModelConfig
from lamina.model.device_attention import PaddedSlots, padded_attention
from lamina.model.kv_attention import NATIVE, SlotBatch, SlotPools, SlotStep, buffer_attention, slot_attention
from lamina.model.kv_quant import KV_QUANT_CHOICES, Q4Rows
from lamina.model.paged_decode import PagedSlots, paged_attention, paged_available
from lamina.model.placement import runs_natively
from lamina.model.uploads import upload
from lamina.services.attention.attention_checks import (
    KVShape,
    PendingStore,
    check_attend,
    check_held,
    check_members,
    check_store,
)
from lamina.services.wire import RemoteError, StoreKV, short_repr

# What Q, K and V may arrive as: each is converted to the worker's device and KV dtype.
ACCEPTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_STEP_SLOTS_KEPT = 8  # micro-batches in flight on one worker, with room to spare
# Prompts whose layers may be arriving at once: a prefill worker sends a batch's few at a
# time; the bound keeps a sender that starts stores and never ends them from growing
# the table without end (a failed store holds no KV, only its entry).
_MAX_PENDING_STORES = 1024


@dataclass(frozen=True)
class _StepSlots:
    versions: tuple[int, ...]  # each sequence's slot_version when this was built
    batch: SlotBatch  # every slot of the micro-batch's sequences
    new: torch.Tensor  # int64 [T]: the slots of the step's new tokens, in row order (on the pools' device)
    # The batch laid out for the paged kernel (a GPU) or the torch path (any other device but
    # CPU float32); None where the native kernel runs.
    table: PagedSlots | PaddedSlots | None
    # The native kernel's decode path (float32 pools), addressed once for every layer.
    fast: SlotStep | None = None
    # The step's tables for the attention's CUDA graphs (lamina.model.attend_graphs), made
    # by the first decode frame they serve.
    graph_tables: StepTables | None = None

    def decode_path(self, query_lens: Sequence[int]) -> SlotStep | None:
        """The step's SlotStep when it serves these new tokens per sequence (it was built
        for the step's own), else None."""
        fast = self.fast
        return fast if fast is not None and fast.query_lens == tuple(query_lens) else None


class AttentionCore:
    def __init__(self, cfg: ModelConfig, capacity_bytes: int, num_kv_heads: int, tokens_per_slab: int = 64,
                 kv_quant: str = "none", device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 cuda_graphs: bool = False) -> None:
        """`cuda_graphs`: where the paged kernel serves (a GPU), each decode frame's
        attention replayed as a CUDA graph (lamina.model.attend_graphs; on other devices
        that serve it, under Triton's interpreter, its body run eagerly)."""
        if kv_quant not in KV_QUANT_CHOICES:
            raise ValueError(f"attention.kv_quant must be one of {', '.join(KV_QUANT_CHOICES)}, got {kv_quant!r}")
        self.cfg = cfg
        self.num_kv_heads = num_kv_heads
        self.device, self.dtype = torch.device(device), dtype
        # The native kernel reads CPU float32 (or 4-bit) pools; a GPU's attend through the
        # paged Triton kernel (lamina.model.paged_decode), anything else through torch's
        # operators (lamina.model.device_attention).
        self.native = runs_natively(self.device, dtype)
        self.paged = not self.native and paged_available(self.device)
        self.packed = Q4Rows(cfg.head_dim) if kv_quant == "q4" else None
        if self.packed is not None and not self.native:
            raise ValueError("attention.kv_quant q4 needs attention.device cpu and attention.dtype float32")
        # Packed pools are [S, Hkv, row_bytes] uint8: the slab allocator's rows are then
        # the packed bytes of a head, which is all it needs to know of the format.
        row, pool_dtype = (cfg.head_dim, dtype) if self.packed is None else (self.packed.row_bytes, torch.uint8)
        try:
            self.slabs = SlabAllocator(SlabConfig(cfg.num_layers, num_kv_heads, row, capacity_bytes,
                                                  tokens_per_slab=tokens_per_slab, dtype=pool_dtype,
                                                  device=str(self.device)))
        except ValueError as exc:
            raise ValueError(f"attention.kv_capacity_bytes: {exc}") from exc
        self.shape = KVShape(cfg.num_layers, cfg.num_groups * num_kv_heads, num_kv_heads, cfg.head_dim,
                             ACCEPTED_DTYPES)
        self._storing: dict[str, PendingStore] = {}  # prefilled sequences whose layers are arriving
        # Every held sequence's last store message, step or fork (time.monotonic): what
        # `retain` frees once no request holds it.
        self._touched: dict[str, float] = {}
        # Per micro-batch (its sequence ids, in row order): the slots its layers read.
        self._step_slots: dict[tuple[str, ...], _StepSlots] = {}
        # The native kernel's decode path over float32 pools (SlotStep), its pools checked once.
        self._slot_pools = (SlotPools(self.slabs.k_pools, self.slabs.v_pools)
                            if self.native and self.packed is None and NATIVE is not None else None)
        self.graphs = (AttendGraphs(self.slabs.k_pools, self.slabs.v_pools, self.shape.num_q_heads,
                                    capture=self.device.type == "cuda")
                       if cuda_graphs and self.paged else None)

    def warm_up(self) -> int:
        """The paged kernel compiled (and Triton's launcher built) before the first frame
        waits on it: seconds on a machine that has not run it, which a model worker's
        reply deadline would count. One query over slot 0 of layer 0, with q in the
        pools' dtype and in float32 (what a model worker in another dtype sends); the
        results are dropped and nothing is stored. Returns the calls made (0 where no
        paged kernel serves this core)."""
        if not self.paged:
            return 0
        k_pool, v_pool = self.slabs.k_pools[0], self.slabs.v_pools[0]
        table = PagedSlots.of(SlotBatch(torch.zeros(1, dtype=torch.int64), (1,), self.slabs.config.num_slots),
                              self.device)
        calls = 0
        for dtype in dict.fromkeys((self.dtype, torch.float32)):
            q = torch.zeros(1, self.shape.num_q_heads, self.cfg.head_dim, dtype=dtype, device=self.device)
            paged_attention(q, [1], k_pool, v_pool, table, need_lse=True)
            calls += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return calls

    # -- decode ---------------------------------------------------------------------------
    def _check(self, layer: int, seqs: list[tuple[str, int]], q: torch.Tensor,
               kv: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Refuses a frame that does not fit this worker before any state changes."""
        check_attend(self.shape, self.slabs, self._storing, layer, seqs, q, kv)

    def _slots(self, seqs: list[tuple[str, int]]) -> _StepSlots:
        """The micro-batch's slots, built once and reused by its later layers.

        A sequence's slots change only when it is extended (layer 0 of a step), copied
        on write or freed, and each of those changes its slot version: an entry whose
        versions still hold is right, whatever other micro-batches did in between."""
        ids = tuple(s for s, _ in seqs)
        versions = tuple(map(self.slabs.slot_version, ids))
        hit = self._step_slots.get(ids)
        if hit is not None and hit.versions == versions:
            return hit
        lens = tuple(map(self.slabs.num_tokens, ids))
        batch = SlotBatch(self.slabs.batch_slots(ids), lens, self.slabs.config.num_slots)
        # The step's new tokens are each sequence's last n positions. (Q-early's layer 0
        # reads the slots before the step extends its sequences, and not these: min()
        # keeps each range inside its sequence there.)
        new_rows = array("q", chain.from_iterable(
            range(end - min(n, m), end) for end, m, (_, n) in zip(accumulate(lens), lens, seqs)))
        new = (batch.slots[torch.frombuffer(new_rows, dtype=torch.int64)] if new_rows
               else torch.empty(0, dtype=torch.int64))
        fast = None
        if self._slot_pools is not None:
            fast = SlotStep(self._slot_pools, batch, [min(n, m) for m, (_, n) in zip(lens, seqs)], new)
        entry = _StepSlots(versions, batch, upload(new, self.device),
                           None if self.native else self._table(batch), fast)
        self._step_slots.pop(ids, None)
        if len(self._step_slots) >= _STEP_SLOTS_KEPT:
            self._step_slots.pop(next(iter(self._step_slots)))  # the oldest micro-batch
        self._step_slots[ids] = entry
        return entry

    def _table(self, batch: SlotBatch) -> PagedSlots | PaddedSlots:
        return PagedSlots.of(batch, self.device) if self.paged else PaddedSlots.of(batch, self.device)

    def _here(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """An arriving tensor on this worker's device, in `dtype` (default the pools'). Only
        a copy from the host is asynchronous: one off a GPU to the host waits, else it
        would be read before it landed."""
        return t.to(self.device, dtype or self.dtype, non_blocking=t.device.type == "cpu")

    def _attention(self, layer: int, q: torch.Tensor, query_lens: list[int], step: _StepSlots,
                   kv_lens: Sequence[int] | None = None, causal: bool = True, need_lse: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The native kernel on CPU float32 pools, the paged kernel on a GPU's, torch's
        operators on any other; the result on q's device in q's dtype (a frame's q is on
        the CPU, what goes back on the wire; a colocated caller's may be on the pools' GPU)."""
        fast = step.decode_path(query_lens)
        if fast is not None and kv_lens is None and causal and not need_lse and q.dtype == torch.float32:
            return fast.attend(layer, q.contiguous()), None
        k_pool, v_pool = self.slabs.k_pools[layer], self.slabs.v_pools[layer]
        if step.table is None:  # the kernel reads float32 queries, whatever the sender computes in
            out, lse = slot_attention(q.float().contiguous(), query_lens, k_pool, v_pool, step.batch, kv_lens,
                                      causal=causal, need_lse=need_lse, packed=self.packed)
            return out.to(q.dtype), lse
        attend = paged_attention if isinstance(step.table, PagedSlots) else padded_attention
        out, lse = attend(self._here(q, q.dtype), query_lens, k_pool, v_pool, step.table,  # type: ignore[arg-type]
                          kv_lens, causal=causal, need_lse=need_lse)
        return out.to(q.device, q.dtype), None if lse is None else lse.to(q.device)

    def _rows(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [T, Hkv, D] as the pools hold them: on the device in the KV's dtype, or
        packed [T, Hkv, row_bytes]."""
        if self.packed is None:
            return self._here(k), self._here(v)
        return self.packed.quantize(k), self.packed.quantize(v)  # [T, Hkv, row_bytes] each

    def _append(self, layer: int, seqs: list[tuple[str, int]], k: torch.Tensor, v: torch.Tensor) -> _StepSlots:
        """Write the step's new K, V (extending the sequences at layer 0) in one indexed
        write per pool; the new slots are fresh (never shared), so no copy-on-write."""
        if layer == 0:
            self._extend(seqs)
        step = self._slots(seqs)
        fast = step.decode_path([n for _, n in seqs])
        if fast is not None and k.dtype == v.dtype == torch.float32:
            fast.append(layer, k.contiguous(), v.contiguous())
            return step
        k, v = self._rows(k, v)
        self.slabs.k_pools[layer][step.new] = k  # [T, Hkv, D] (or packed rows) into the pool's rows
        self.slabs.v_pools[layer][step.new] = v
        return step

    def attend(self, layer: int, seqs: list[tuple[str, int]], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               need_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append the new tokens' K, V; attention of their queries over every token.

        seqs: (seq_id, n_new) in row order; q: [T, Hq, D]; k, v: [T, Hkv, D].
        Returns out [T, Hq, D] and, if asked, lse [T, Hq]: one kernel call over every
        sequence, reading the slab pools in place."""
        self._check(layer, seqs, q, (k, v))
        if not need_lse and self._graphed(seqs, q, k, v):
            return self._attend_graphed(layer, seqs, q, k, v), None
        step = self._append(layer, seqs, k, v)
        return self._attention(layer, q, [n for _, n in seqs], step, need_lse=need_lse)

    def _graphed(self, seqs: list[tuple[str, int]], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether the attention's CUDA graphs serve this decode frame."""
        graphs = self.graphs
        return graphs is not None and graphs.serves([n for _, n in seqs]) and graphs.accepts(q, k, v)

    def _attend_graphed(self, layer: int, seqs: list[tuple[str, int]], q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor) -> torch.Tensor:
        """`attend` of a frame the graphs serve (checked already): the sequences extended at
        layer 0, the step's tables made once, and one replay that writes the new K, V and
        attends. The output on q's device, as the eager path answers."""
        graphs = self.graphs
        assert graphs is not None  # _graphed said so
        if layer == 0:
            self._extend(seqs)
        step = self._slots(seqs)
        tables = step.graph_tables
        if tables is None:
            assert isinstance(step.table, PagedSlots)  # the graphs exist where the paged kernel serves
            tables = graphs.tables(step.batch.lens, step.batch.slots, step.table.slots)
            self._step_slots[tuple(s for s, _ in seqs)] = replace(step, graph_tables=tables)
        return graphs.attend(layer, tables, q, k, v).to(q.device)

    def local_step(self, seqs: list[tuple[str, int]]) -> Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor],
                                                                   torch.Tensor]:
        """A decode step's attention for a caller in this process that calls it for layers
        0, 1, ... in turn with nothing else using this core in between (a colocated
        model worker's step, which never awaits): call(layer, q, k, v) -> out, what
        `attend` returns. Layer 0 is `attend` itself, checked whole, and extends the
        sequences; on the native decode path the later layers write and attend through
        the step's SlotStep, which checks their shapes, skipping the checks of the
        sequences' state that only layer 0 could fail. Any other call is `attend`. The
        later layers' outputs are one tensor, written again by each: the caller reads each
        layer's output before it calls the next (SplitModel.run)."""
        ids, lens = tuple(s for s, _ in seqs), [n for _, n in seqs]
        fast: SlotStep | None = None
        expected = 1  # the layer after the last one served
        fast_out: torch.Tensor | None = None  # [T, Hq, D], every fast-path layer's output

        def call(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            nonlocal fast, expected, fast_out
            if (fast is not None and layer == expected and q.dtype == k.dtype == v.dtype == torch.float32
                    and layer < self.shape.num_layers):
                expected += 1
                fast.append(layer, k.contiguous(), v.contiguous())
                fast_out = fast.attend(layer, q.contiguous(), fast_out)
                return fast_out
            out, _ = self.attend(layer, seqs, q, k, v)
            if layer == 0:
                step = self._step_slots.get(ids)  # what that attend built or reused
                fast = None if step is None else step.decode_path(lens)
                expected = 1
            else:
                fast = None  # out of order: every later layer checked whole
            return out

        return call

    def decode_step(self, seqs: list[tuple[str, int]]) -> tuple[list[int], torch.Tensor]:
        """A decode step's sequences extended by their new tokens, for a caller that then
        writes and attends every layer itself (a colocated model worker's step replayed as
        a CUDA graph, lamina.model.step_graphs.SlabStepGraphs, over this core's pools):
        what `attend` checks and does at layer 0, without its K, V. Returns each sequence's
        keys (its new ones included) and their slots (int64 [sum], in order, on the CPU)."""
        check_members(seqs)
        check_held(self.slabs, self._storing, 0, seqs)
        self._extend(seqs)
        ids = [s for s, _ in seqs]
        return [self.slabs.num_tokens(s) for s in ids], self.slabs.batch_slots(ids)

    def _extend(self, seqs: list[tuple[str, int]]) -> None:
        """Every sequence extended by its new tokens (a step's layer 0), or none: kv_full."""
        needed = sum(n for _, n in seqs)
        if not self.slabs.can_allocate(needed):
            raise RemoteError("kv_full", f"{needed} more tokens asked, {self.slabs.num_free_tokens} free")
        now = monotonic()
        for seq_id, n in seqs:
            self.slabs.extend(seq_id, n)
            self._touched[seq_id] = now

    def attend_held(self, layer: int, seqs: list[tuple[str, int]], q: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Q-early, first half: attention of the new queries over the KV held before
        this step's tokens (every held token is visible to each query), before this
        layer's K, V arrive. Returns out [T, Hq, D] and lse [T, Hq] (-inf where a
        sequence held nothing)."""
        self._check(layer, seqs, q, None)
        step = self._slots(seqs)
        # Layer 0 comes before the step extends the sequences: all they hold is old.
        held = step.batch.lens if layer == 0 else [m - n for m, (_, n) in zip(step.batch.lens, seqs)]
        out, lse = self._attention(layer, q, [n for _, n in seqs], step, held, causal=False, need_lse=True)
        assert lse is not None  # asked for with need_lse=True
        return out, lse

    def append_and_combine(self, layer: int, seqs: list[tuple[str, int]], q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, held_out: torch.Tensor, held_lse: torch.Tensor) -> torch.Tensor:
        """Q-early, second half: append K, V, attend the new tokens among themselves
        (causally) and combine with the held part by log-sum-exp. Returns out [T, Hq, D]."""
        self._check(layer, seqs, q, (k, v))
        step = self._append(layer, seqs, k, v)
        # The new tokens as the pools now hold them (rounded to the KV's dtype, or packed),
        # beside the held part on q's device (a frame's: the CPU).
        k, v = (pool[layer][step.new] for pool in (self.slabs.k_pools, self.slabs.v_pools))
        if self.packed is not None:
            k, v = self.packed.dequantize(k), self.packed.dequantize(v)
        k, v = k.to(q.device, torch.float32), v.to(q.device, torch.float32)
        q = q.float()
        lens = [n for _, n in seqs]
        if all(n == 1 for n in lens):
            # One new token sees only itself: its output is its V, its lse its own score.
            g = q.shape[1] // k.shape[1]
            new_out = v.repeat_interleave(g, dim=1)  # [T, Hq, D]
            new_lse = (q * k.repeat_interleave(g, dim=1)).sum(-1) * q.shape[-1] ** -0.5  # [T, Hq]
        else:  # the CPU kernel, on CPU copies where q is elsewhere
            k, v = k.cpu().contiguous(), v.cpu().contiguous()
            starts = [0, *accumulate(lens)]
            keys = [k[s : s + n] for s, n in zip(starts, lens)]
            new_out, new_lse = buffer_attention(q.cpu().contiguous(), lens, keys,
                                                [v[s : s + n] for s, n in zip(starts, lens)])
            assert new_lse is not None  # buffer_attention's need_lse defaults to True
            new_out, new_lse = new_out.to(q.device), new_lse.to(q.device)
        return combine_partials(held_out.float(), held_lse, new_out, new_lse)[0].to(held_out.dtype)

    # -- prompt KV from prefill -----------------------------------------------------------
    def store(self, msg: StoreKV) -> bool:
        """Install a prefilled sequence's KV, one layer per message. True after the last.

        The sender expects one reply per sequence, after its last layer: a failure of
        a well-formed store (no room at layer 0) is remembered and raised then, and
        the layers in between are dropped. A message that fails the checks raises at
        once (the worker answers it) and changes nothing but this: a store it belonged
        to is abandoned, its KV freed, and its last layer raises too.
        """
        seq_id = msg.seq_id
        pending = self._storing.get(seq_id)
        self._touched[seq_id] = monotonic()
        try:
            check_store(self.shape, msg, pending)
        except RemoteError as exc:
            if pending is not None:
                self._abandon(msg, pending, exc)
            raise
        if msg.layer == 0:
            if pending is None and len(self._storing) >= _MAX_PENDING_STORES:
                raise RemoteError("kv_full", f"{len(self._storing)} stores are already in progress")
            self._storing.pop(seq_id, None)
            if self.slabs.has_request(seq_id):
                self.slabs.free(seq_id)  # stored again: the new prompt KV replaces the old
            pending = self._storing[seq_id] = PendingStore(0, msg.k.shape[0])
            try:
                self.slabs.allocate(seq_id, pending.num_tokens)
            except KVAllocationError as exc:
                pending.error = RemoteError("kv_full", str(exc))
        assert pending is not None  # check_store refuses a later layer without its layer 0
        if pending.error is None:
            self.slabs.write(seq_id, msg.layer, 0, *self._rows(msg.k, msg.v))
        pending.next_layer += 1
        if msg.layer != msg.num_layers - 1:
            return False
        del self._storing[seq_id]
        if pending.error is not None:
            raise pending.error
        return True

    def _abandon(self, msg: StoreKV, pending: PendingStore, error: RemoteError) -> None:
        """A refused message named a store in progress: free its KV; unless the message
        was its last layer, the layers still to come are dropped and the last raises `error`."""
        if pending.error is None:
            if self.slabs.has_request(msg.seq_id):
                self.slabs.free(msg.seq_id)
            pending.error = error
        if msg.layer == self.shape.num_layers - 1:
            del self._storing[msg.seq_id]
        elif msg.layer == pending.next_layer:
            pending.next_layer += 1

    def fork(self, source: str, seq_ids: list[str], num_tokens: int) -> None:
        """New sequences sharing the first `num_tokens` tokens of `source` by reference
        (the slab allocator's fork: nothing is copied; each appends its own tokens to
        fresh slots). Refused, before any change, unless `source` is held whole with that
        many tokens and every new id is distinct and unused."""
        if not self.slabs.has_request(source) or source in self._storing:
            raise RemoteError("unknown_sequence", f"no KV for sequence {short_repr(source)}")
        if not 1 <= num_tokens <= self.slabs.num_tokens(source):
            raise RemoteError("bad_request", f"cannot share {num_tokens} tokens of {short_repr(source)}, which "
                                             f"holds {self.slabs.num_tokens(source)}")
        taken = [s for s in seq_ids if self.slabs.has_request(s) or s in self._storing]
        if taken or len(set(seq_ids)) != len(seq_ids) or source in seq_ids:
            raise RemoteError("bad_request", f"fork of {short_repr(source)} into sequences that exist or repeat: "
                                             f"{short_repr(seq_ids)}")
        now = monotonic()
        for s in seq_ids:
            self.slabs.fork(source, s, num_tokens)
            self._touched[s] = now
        self._touched[source] = now

    def free(self, seq_ids: list[str]) -> None:
        """Forget sequences: their KV, and a store of theirs in progress (whose later
        layers are then refused as unknown)."""
        for s in seq_ids:
            self._storing.pop(s, None)
            self._touched.pop(s, None)
            if self.slabs.has_request(s):
                self.slabs.free(s)

    def retain(self, live: set[str], idle_s: float) -> list[str]:
        """Free every sequence not in `live` untouched for `idle_s` or more (the
        scheduler's reconciliation: KV no request holds); the ids freed."""
        now = monotonic()
        # A refused store message touches an id that holds nothing: forget those too.
        self._touched = {s: t for s, t in self._touched.items() if self.slabs.has_request(s) or s in self._storing}
        stale = [s for s, t in self._touched.items() if s not in live and now - t >= idle_s]
        self.free(stale)
        return stale

    # -- accounting -----------------------------------------------------------------------
    @property
    def num_sequences(self) -> int:
        return self.slabs.num_requests

    @property
    def used_bytes(self) -> int:
        return self.slabs.num_used_tokens * self.slabs.config.bytes_per_token

    @property
    def capacity_bytes(self) -> int:
        return self.slabs.num_total_tokens * self.slabs.config.bytes_per_token
