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

import torch

from kvstore.slab import KVAllocationError, SlabAllocator, SlabConfig
from model.attention import attention_with_lse, batched_attention, combine_partials
from model.config import ModelConfig
from services.wire import RemoteError, StoreKV


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

    # -- decode ---------------------------------------------------------------------------
    def _check(self, seqs: list[tuple[str, int]], kv_heads: int | None) -> None:
        if kv_heads is not None and kv_heads != self.num_kv_heads:
            raise RemoteError("bad_request", f"sent {kv_heads} KV heads, this worker holds {self.num_kv_heads}")
        unknown = [s for s, _ in seqs if not self.slabs.has_request(s)]
        if unknown:
            # Decoding a sequence whose prompt KV never arrived (or was freed) would
            # silently attend over nothing: refuse it.
            raise RemoteError("unknown_sequence", f"no KV for sequence(s) {', '.join(map(repr, unknown))}")

    def _append(self, layer: int, seqs: list[tuple[str, int]], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the step's new K, V (extending the sequences at layer 0)."""
        if layer == 0:
            needed = sum(n for _, n in seqs)
            if not self.slabs.can_allocate(needed):
                raise RemoteError("kv_full", f"{needed} more tokens asked, {self.slabs.num_free_tokens} free")
            for seq_id, n in seqs:
                self.slabs.extend(seq_id, n)
        start = 0
        for seq_id, n in seqs:
            total = self.slabs.num_tokens(seq_id)
            self.slabs.write(seq_id, layer, total - n, k[start : start + n], v[start : start + n])
            start += n

    def attend(self, layer: int, seqs: list[tuple[str, int]], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               need_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append the new tokens' K, V; attention of their queries over every token.

        seqs: (seq_id, n_new) in row order; q: [T, Hq, D]; k, v: [T, Hkv, D].
        Returns out [T, Hq, D] and, if asked, lse [T, Hq]."""
        self._check(seqs, k.shape[1])
        self._append(layer, seqs, k, v)
        keys, values = zip(*(self.slabs.read(s, layer) for s, _ in seqs))  # each [L, Hkv, D]
        out, lse = batched_attention(q, [n for _, n in seqs], keys, values)
        return out, lse if need_lse else None

    def attend_held(self, layer: int, seqs: list[tuple[str, int]], q: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Q-early, first half: attention of the new queries over the KV held before
        this step's tokens (every held token is visible to each query).
        Returns out [T, Hq, D] and lse [T, Hq]."""
        self._check(seqs, None)
        outs, lses = [], []
        start = 0
        for seq_id, n in seqs:
            held = self.slabs.num_tokens(seq_id) - (n if layer > 0 else 0)  # layer 0 extends later
            k, v = self.slabs.read(seq_id, layer)
            out, lse = attention_with_lse(q[start : start + n], k[:held], v[:held], causal=False)
            outs.append(out)
            lses.append(lse)
            start += n
        return torch.cat(outs), torch.cat(lses)

    def append_and_combine(self, layer: int, seqs: list[tuple[str, int]], q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, held_out: torch.Tensor, held_lse: torch.Tensor) -> torch.Tensor:
        """Q-early, second half: append K, V, attend the new tokens among themselves
        (causally) and combine with the held part by log-sum-exp. Returns out [T, Hq, D]."""
        self._check(seqs, k.shape[1])
        self._append(layer, seqs, k, v)
        lens = [n for _, n in seqs]
        starts = [sum(lens[:i]) for i in range(len(lens))]
        new_keys = [k[s : s + n] for s, n in zip(starts, lens)]
        new_values = [v[s : s + n] for s, n in zip(starts, lens)]
        new_out, new_lse = batched_attention(q, lens, new_keys, new_values)
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
