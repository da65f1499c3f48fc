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
from model.attention import batched_attention
from model.config import ModelConfig
from services.wire import Attend, RemoteError, StoreKV


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
    def attend(self, msg: Attend) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens' K, V; attention of their queries. Returns out, lse."""
        if msg.k.shape[1] != self.num_kv_heads:
            raise RemoteError("bad_request", f"sent {msg.k.shape[1]} KV heads, this worker holds {self.num_kv_heads}")
        unknown = [s for s, _ in msg.seqs if not self.slabs.has_request(s)]
        if unknown:
            # Decoding a sequence whose prompt KV never arrived (or was freed) would
            # silently attend over nothing: refuse it.
            raise RemoteError("unknown_sequence", f"no KV for sequence(s) {', '.join(map(repr, unknown))}")
        if msg.layer == 0:
            needed = sum(n for _, n in msg.seqs)
            if not self.slabs.can_allocate(needed):
                raise RemoteError("kv_full", f"{needed} more tokens asked, {self.slabs.num_free_tokens} free")
            for seq_id, n in msg.seqs:
                self.slabs.extend(seq_id, n)
        keys, values, lens = [], [], []
        start = 0
        for seq_id, n in msg.seqs:
            total = self.slabs.num_tokens(seq_id)
            self.slabs.write(seq_id, msg.layer, total - n, msg.k[start : start + n], msg.v[start : start + n])
            k, v = self.slabs.read(seq_id, msg.layer)  # [T, Hkv, D]
            keys.append(k)
            values.append(v)
            lens.append(n)
            start += n
        return batched_attention(msg.q, lens, keys, values)

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
