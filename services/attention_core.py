"""The attention worker's state and arithmetic, without I/O.

Holds each sequence's K and V for the KV heads this worker owns, in the
token-granular store, and computes attention for the rows it is sent. The
service wraps it in a transport listener and a gRPC control server.
"""

from __future__ import annotations

import torch

from lamina.engine.kv import KVCapacityError, KVStore
from model.attention import batched_attention
from model.config import ModelConfig
from services.wire import Attend, RemoteError, StoreKV


class AttentionCore:
    def __init__(self, cfg: ModelConfig, capacity_bytes: int, num_kv_heads: int) -> None:
        self.cfg = cfg
        self.num_kv_heads = num_kv_heads
        self.kv = KVStore(cfg, capacity_bytes, num_kv_heads=num_kv_heads)
        self._failed: dict[str, RemoteError] = {}  # prefilled sequences whose store failed

    def attend(self, msg: Attend) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens' K, V; attention of their queries. Returns out, lse."""
        if msg.k.shape[1] != self.num_kv_heads:
            raise RemoteError("bad_request", f"sent {msg.k.shape[1]} KV heads, this worker holds {self.num_kv_heads}")
        unknown = [s for s, _ in msg.seqs if s not in self.kv]
        if unknown:
            # Decoding a sequence whose prompt KV never arrived (or was freed) would
            # silently attend over nothing: refuse it.
            raise RemoteError("unknown_sequence", f"no KV for sequence(s) {', '.join(map(repr, unknown))}")
        if msg.layer == 0:
            for seq_id, n in msg.seqs:
                try:
                    self.kv.reserve(seq_id, self.kv.get(seq_id).length + n)
                except KVCapacityError as exc:
                    raise RemoteError("kv_full", str(exc)) from exc
        keys, values, lens = [], [], []
        start = 0
        for seq_id, n in msg.seqs:
            kk, vv = self.kv.get(seq_id).write(msg.layer, msg.k[start : start + n], msg.v[start : start + n])
            keys.append(kk)
            values.append(vv)
            lens.append(n)
            start += n
        out, lse = batched_attention(msg.q, lens, keys, values)
        if msg.commit:
            for seq_id, n in msg.seqs:
                self.kv.get(seq_id).length += n
        return out, lse

    def store(self, msg: StoreKV) -> bool:
        """Install a prefilled sequence's KV, one layer per message. True after the last.

        The sender expects exactly one reply per sequence, after its last layer: a
        failure at any layer is remembered and raised then, and the layers in
        between are dropped.
        """
        is_last = msg.layer == msg.num_layers - 1
        if msg.layer == 0:
            self._failed.pop(msg.seq_id, None)
            self.kv.free(msg.seq_id)
            try:
                self.kv.reserve(msg.seq_id, msg.k.shape[0])
            except KVCapacityError as exc:
                self._failed[msg.seq_id] = RemoteError("kv_full", str(exc))
        elif msg.seq_id not in self.kv and msg.seq_id not in self._failed:
            self._failed[msg.seq_id] = RemoteError("unknown_sequence", f"layer {msg.layer} of {msg.seq_id!r} "
                                                   "arrived before layer 0")
        if msg.seq_id not in self._failed:
            self.kv.get(msg.seq_id).write(msg.layer, msg.k, msg.v)
        if not is_last:
            return False
        error = self._failed.pop(msg.seq_id, None)
        if error is not None:
            self.kv.free(msg.seq_id)
            raise error
        self.kv.get(msg.seq_id).length = msg.k.shape[0]
        return True

    def free(self, seq_ids: list[str]) -> None:
        for s in seq_ids:
            self.kv.free(s)
