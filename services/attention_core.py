"""The attention worker's state and arithmetic, without I/O.

Holds each sequence's K and V for the KV heads this worker owns in the
token-granular slab allocator (kvstore.slab), and computes attention for the
rows it is sent. The service wraps it in a transport listener and a gRPC
control server.

What must hold: a sequence is decoded only after its prompt KV arrived whole
(STORE_KV up to the last layer); a decode step extends every sequence by its new
tokens at layer 0 and writes them in every layer before the step's last frame.
If a step dies midway the scheduler frees its sequences, so no half-written
token is ever read by a later step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstore.slab import KVAllocationError, SlabAllocator, SlabConfig
from model.attention import batched_attention, combine_partials
from model.config import ModelConfig
from model.kv_attention import SlotBatch, slot_attention
from services.wire import RemoteError, StoreKV

_STEP_SLOTS_KEPT = 8  # micro-batches in flight on one worker, with room to spare


@dataclass(frozen=True)
class _StepSlots:
    batch: SlotBatch  # every slot of the step's sequences
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
        self._step_slots: dict[tuple[str, ...], _StepSlots] = {}

    # -- decode ---------------------------------------------------------------------------
    def _check(self, seqs: list[tuple[str, int]], kv_heads: int | None) -> None:
        if kv_heads is not None and kv_heads != self.num_kv_heads:
            raise RemoteError("bad_request", f"sent {kv_heads} KV heads, this worker holds {self.num_kv_heads}")
        unknown = [s for s, _ in seqs if not self.slabs.has_request(s)]
        if unknown:
            # Decoding a sequence whose prompt KV never arrived (or was freed) would
            # silently attend over nothing: refuse it.
            raise RemoteError("unknown_sequence", f"no KV for sequence(s) {', '.join(map(repr, unknown))}")

    def _slots(self, seqs: list[tuple[str, int]]) -> _StepSlots:
        """The step's slots, built once and reused by every later layer of the step.

        A micro-batch's sequences keep their slots from layer 1 to the last layer (they
        grow at layer 0 only), so the cache entry of the same sequences with the same
        lengths is still right; `free` and a new prompt's first layer clear the cache."""
        key = tuple(s for s, _ in seqs)
        lens = tuple(self.slabs.num_tokens(s) for s in key)
        hit = self._step_slots.get(key)
        if hit is not None and hit.batch.lens == lens:
            return hit
        per_seq = [self.slabs.slots(s) for s in key]
        new = [slot for slots, (_, n) in zip(per_seq, seqs) for slot in slots[len(slots) - n:]]
        entry = _StepSlots(SlotBatch.build(per_seq, self.slabs.config.num_slots),
                           torch.tensor(new, dtype=torch.int64))
        if len(self._step_slots) >= _STEP_SLOTS_KEPT:
            self._step_slots.pop(next(iter(self._step_slots)))
        self._step_slots[key] = entry
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
        self._check(seqs, k.shape[1])
        step = self._append(layer, seqs, k, v)
        return slot_attention(q, [n for _, n in seqs], self.slabs.k_pools[layer], self.slabs.v_pools[layer],
                              step.batch, need_lse=need_lse)

    def attend_held(self, layer: int, seqs: list[tuple[str, int]], q: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Q-early, first half: attention of the new queries over the KV held before
        this step's tokens (every held token is visible to each query).
        Returns out [T, Hq, D] and lse [T, Hq]."""
        self._check(seqs, None)
        step = self._slots(seqs) if layer > 0 else self._slots([(s, 0) for s, _ in seqs])
        # Layer 0 comes before the step extends the sequences: all they hold is old.
        held = [m - (n if layer > 0 else 0) for m, (_, n) in zip(step.batch.lens, seqs)]
        out, lse = slot_attention(q, [n for _, n in seqs], self.slabs.k_pools[layer], self.slabs.v_pools[layer],
                                  step.batch, held, causal=False, need_lse=True)
        return out, lse

    def append_and_combine(self, layer: int, seqs: list[tuple[str, int]], q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, held_out: torch.Tensor, held_lse: torch.Tensor) -> torch.Tensor:
        """Q-early, second half: append K, V, attend the new tokens among themselves
        (causally) and combine with the held part by log-sum-exp. Returns out [T, Hq, D]."""
        self._check(seqs, k.shape[1])
        self._append(layer, seqs, k, v)
        lens = [n for _, n in seqs]
        if all(n == 1 for n in lens):
            # One new token sees only itself: its output is its V, its lse its own score.
            g = q.shape[1] // k.shape[1]
            new_out = v.repeat_interleave(g, dim=1)  # [T, Hq, D]
            new_lse = (q * k.repeat_interleave(g, dim=1)).sum(-1) * q.shape[-1] ** -0.5  # [T, Hq]
        else:
            starts = [sum(lens[:i]) for i in range(len(lens))]
            new_out, new_lse = batched_attention(q, lens, [k[s : s + n] for s, n in zip(starts, lens)],
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
            self._step_slots.clear()
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
        self._step_slots.clear()
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
