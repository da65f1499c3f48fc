"""The attention worker's state and arithmetic, without I/O.

Holds each sequence's K and V for the KV heads this worker owns in the
token-granular slab allocator (kvstore.slab), and computes attention for the
rows it is sent: per frame, the new tokens' K and V go into the pools in one
indexed write each, and one call of the batched kernel (model.kv_attention)
attends every sequence of the frame, reading the pools in place. The slots a
micro-batch reads are concatenated once per step and kept while its sequences'
slots do not change. The service wraps it in a transport listener and a gRPC
control server.

Several micro-batches interleave their layers on one worker, each with its own
sequences; nothing here tracks a step in progress except through the sequences
themselves (their lengths and slot versions), so any interleaving is served.

What must hold: a sequence is decoded only after its prompt KV arrived whole
(STORE_KV up to the last layer); a decode step extends every sequence by its new
tokens at layer 0 and writes them in every layer before the step's last frame.
If a step dies midway the scheduler frees its sequences, so no half-written
token is ever read by a later step.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from itertools import accumulate, chain

import torch

from kvstore.slab import KVAllocationError, SlabAllocator, SlabConfig
from model.attention import combine_partials
from model.config import ModelConfig
from model.kv_attention import SlotBatch, buffer_attention, slot_attention
from services.wire import RemoteError, StoreKV

_STEP_SLOTS_KEPT = 8  # micro-batches in flight on one worker, with room to spare


@dataclass(frozen=True)
class _StepSlots:
    versions: tuple[int, ...]  # each sequence's slot_version when this was built
    batch: SlotBatch  # every slot of the micro-batch's sequences
    new: torch.Tensor  # int64 [T]: the slots of the step's new tokens, in row order


class AttentionCore:
    def __init__(self, cfg: ModelConfig, capacity_bytes: int, num_kv_heads: int, tokens_per_slab: int = 64) -> None:
        self.cfg = cfg
        self.num_kv_heads = num_kv_heads
        try:
            self.slabs = SlabAllocator(SlabConfig(cfg.num_layers, num_kv_heads, cfg.head_dim, capacity_bytes,
                                                  tokens_per_slab=tokens_per_slab))
        except ValueError as exc:
            raise ValueError(f"attention.kv_capacity_bytes: {exc}") from exc
        self._failed: dict[str, RemoteError] = {}  # prefilled sequences whose store failed
        # Per micro-batch (its sequence ids, in row order): the slots its layers read.
        self._step_slots: dict[tuple[str, ...], _StepSlots] = {}

    # -- decode ---------------------------------------------------------------------------
    def _check(self, seqs: list[tuple[str, int]], q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor] | None
               ) -> None:
        """Refuses a frame that does not fit this worker before any state changes."""
        rows = sum(n for _, n in seqs)
        heads = self.cfg.num_groups * self.num_kv_heads  # the query heads of this worker's KV heads
        if any(n < 1 for _, n in seqs) or q.shape != (rows, heads, self.cfg.head_dim):
            raise RemoteError("bad_request", f"q {tuple(q.shape)} for {rows} new tokens of {len(seqs)} sequences: "
                                             f"this worker attends {heads} query heads of {self.cfg.head_dim}")
        if kv is not None and not kv[0].shape == kv[1].shape == (rows, self.num_kv_heads, self.cfg.head_dim):
            raise RemoteError("bad_request", f"k {tuple(kv[0].shape)}, v {tuple(kv[1].shape)}: this worker holds "
                                             f"{self.num_kv_heads} KV heads of {self.cfg.head_dim} for {rows} tokens")
        unknown = [s for s, _ in seqs if not self.slabs.has_request(s)]
        if unknown:
            # Decoding a sequence whose prompt KV never arrived (or was freed) would
            # silently attend over nothing: refuse it.
            raise RemoteError("unknown_sequence", f"no KV for sequence(s) {', '.join(map(repr, unknown))}")

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
        # The step's new tokens are each sequence's last n positions.
        new_rows = array("q", chain.from_iterable(
            range(end - n, end) for end, (_, n) in zip(accumulate(lens), seqs)))
        entry = _StepSlots(versions, batch, batch.slots[torch.frombuffer(new_rows, dtype=torch.int64)]
                           if new_rows else torch.empty(0, dtype=torch.int64))
        self._step_slots.pop(ids, None)
        if len(self._step_slots) >= _STEP_SLOTS_KEPT:
            self._step_slots.pop(next(iter(self._step_slots)))  # the oldest micro-batch
        self._step_slots[ids] = entry
        return entry

    def _append(self, layer: int, seqs: list[tuple[str, int]], k: torch.Tensor, v: torch.Tensor) -> _StepSlots:
        """Write the step's new K, V (extending the sequences at layer 0) in one indexed
        write per pool; the new slots are fresh (never shared), so no copy-on-write."""
        if layer == 0:
            needed = sum(n for _, n in seqs)
            if not self.slabs.can_allocate(needed):
                raise RemoteError("kv_full", f"{needed} more tokens asked, {self.slabs.num_free_tokens} free")
            for seq_id, n in seqs:
                self.slabs.extend(seq_id, n)
        step = self._slots(seqs)
        self.slabs.k_pools[layer][step.new] = k  # [T, Hkv, D] into the pool's rows
        self.slabs.v_pools[layer][step.new] = v
        return step

    def attend(self, layer: int, seqs: list[tuple[str, int]], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               need_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append the new tokens' K, V; attention of their queries over every token.

        seqs: (seq_id, n_new) in row order; q: [T, Hq, D]; k, v: [T, Hkv, D].
        Returns out [T, Hq, D] and, if asked, lse [T, Hq]: one kernel call over every
        sequence, reading the slab pools in place."""
        self._check(seqs, q, (k, v))
        step = self._append(layer, seqs, k, v)
        return slot_attention(q.contiguous(), [n for _, n in seqs], self.slabs.k_pools[layer],
                              self.slabs.v_pools[layer], step.batch, need_lse=need_lse)

    def attend_held(self, layer: int, seqs: list[tuple[str, int]], q: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Q-early, first half: attention of the new queries over the KV held before
        this step's tokens (every held token is visible to each query), before this
        layer's K, V arrive. Returns out [T, Hq, D] and lse [T, Hq] (-inf where a
        sequence held nothing)."""
        self._check(seqs, q, None)
        step = self._slots(seqs)
        # Layer 0 comes before the step extends the sequences: all they hold is old.
        held = step.batch.lens if layer == 0 else [m - n for m, (_, n) in zip(step.batch.lens, seqs)]
        out, lse = slot_attention(q.contiguous(), [n for _, n in seqs], self.slabs.k_pools[layer],
                                  self.slabs.v_pools[layer], step.batch, held, causal=False, need_lse=True)
        return out, lse

    def append_and_combine(self, layer: int, seqs: list[tuple[str, int]], q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, held_out: torch.Tensor, held_lse: torch.Tensor) -> torch.Tensor:
        """Q-early, second half: append K, V, attend the new tokens among themselves
        (causally) and combine with the held part by log-sum-exp. Returns out [T, Hq, D]."""
        self._check(seqs, q, (k, v))
        self._append(layer, seqs, k, v)
        lens = [n for _, n in seqs]
        if all(n == 1 for n in lens):
            # One new token sees only itself: its output is its V, its lse its own score.
            g = q.shape[1] // k.shape[1]
            new_out = v.repeat_interleave(g, dim=1)  # [T, Hq, D]
            new_lse = (q * k.repeat_interleave(g, dim=1)).sum(-1) * q.shape[-1] ** -0.5  # [T, Hq]
        else:
            k, v = k.contiguous(), v.contiguous()
            starts = [0, *accumulate(lens)]
            new_out, new_lse = buffer_attention(q.contiguous(), lens, [k[s : s + n] for s, n in zip(starts, lens)],
                                                [v[s : s + n] for s, n in zip(starts, lens)])
        return combine_partials(held_out, held_lse, new_out, new_lse)[0]

    # -- prompt KV from prefill -----------------------------------------------------------
    def store(self, msg: StoreKV) -> bool:
        """Install a prefilled sequence's KV, one layer per message. True after the last.

        The sender expects exactly one reply per sequence, after its last layer: a
        failure at any layer is remembered and raised then, and the layers in
        between are dropped.
        """
        num_tokens = msg.k.shape[0]
        if msg.layer == 0:
            self._failed.pop(msg.seq_id, None)
            if self.slabs.has_request(msg.seq_id):
                self.slabs.free(msg.seq_id)
            try:
                self.slabs.allocate(msg.seq_id, num_tokens)
            except KVAllocationError as exc:
                self._failed[msg.seq_id] = RemoteError("kv_full", str(exc))
        elif not self.slabs.has_request(msg.seq_id) and msg.seq_id not in self._failed:
            self._failed[msg.seq_id] = RemoteError(
                "unknown_sequence", f"layer {msg.layer} of {msg.seq_id!r} arrived before layer 0")
        if msg.seq_id not in self._failed:
            self.slabs.write(msg.seq_id, msg.layer, 0, msg.k, msg.v)
        if msg.layer != msg.num_layers - 1:
            return False
        error = self._failed.pop(msg.seq_id, None)
        if error is not None:
            self.free([msg.seq_id])
            raise error
        return True

    def free(self, seq_ids: list[str]) -> None:
        for s in seq_ids:
            if self.slabs.has_request(s):
                self.slabs.free(s)

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
