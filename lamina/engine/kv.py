"""Token-granular KV storage for the local engine.

Each sequence owns one buffer [num_layers, 2, capacity, Hkv, D] that grows in
fixed token chunks; attention reads exactly the sequence's tokens (no padding,
no gather), and freeing a sequence returns its buffer at once.
"""

from __future__ import annotations

import torch

from lamina.model.config import ModelConfig


class KVCapacityError(RuntimeError):
    """Not enough KV memory for the tokens asked for. The caller can retry later."""


class SequenceKV:
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, chunk_tokens: int, num_kv_heads: int,
                 device: torch.device | None = None) -> None:
        self._cfg = cfg
        self._device = device
        self._dtype = dtype
        self._chunk = chunk_tokens
        self._num_kv_heads = num_kv_heads
        self.length = 0  # tokens whose K, V are stored in every layer
        self.buf = torch.empty(0)

    @property
    def capacity(self) -> int:
        return self.buf.shape[2] if self.buf.dim() == 5 else 0

    def reserve(self, num_tokens: int) -> int:
        """Grow to hold `num_tokens` tokens; returns bytes newly allocated."""
        if num_tokens <= self.capacity:
            return 0
        cap = -(-num_tokens // self._chunk) * self._chunk
        c = self._cfg
        new = torch.empty(c.num_layers, 2, cap, self._num_kv_heads, c.head_dim, dtype=self._dtype,
                          device=self._device)
        old_bytes = self.buf.numel() * self.buf.element_size()
        if self.length:
            new[:, :, : self.length] = self.buf[:, :, : self.length]
        self.buf = new
        return new.numel() * new.element_size() - old_bytes

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' k, v: [n, Hkv, D] after the committed ones; return all keys/values."""
        end = self.length + k.shape[0]
        self.buf[layer, 0, self.length : end] = k
        self.buf[layer, 1, self.length : end] = v
        return self.buf[layer, 0, :end], self.buf[layer, 1, :end]

    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()


class KVStore:
    """All sequences' KV, bounded in bytes.

    `num_kv_heads` is the number of KV heads stored per token: all of the model's,
    or an attention worker's share under head-level partitioning. `device`: where the
    buffers live (None: CPU).
    """

    def __init__(self, cfg: ModelConfig, capacity_bytes: int, dtype: torch.dtype = torch.float32,
                 chunk_tokens: int = 64, num_kv_heads: int | None = None, device: torch.device | None = None) -> None:
        self.cfg = cfg
        self.device = device
        self.num_kv_heads = num_kv_heads or cfg.num_kv_heads
        self.capacity_bytes = capacity_bytes
        self.dtype = dtype
        self.chunk_tokens = chunk_tokens
        self.used_bytes = 0
        self._seqs: dict[str, SequenceKV] = {}
        elem = torch.empty((), dtype=dtype).element_size()
        self.bytes_per_token = 2 * cfg.num_layers * self.num_kv_heads * cfg.head_dim * elem

    def can_reserve(self, seq_id: str, num_tokens: int) -> bool:
        have = self._seqs[seq_id].capacity if seq_id in self._seqs else 0
        extra = max(0, -(-num_tokens // self.chunk_tokens) * self.chunk_tokens - have)
        return self.used_bytes + extra * self.bytes_per_token <= self.capacity_bytes

    def reserve(self, seq_id: str, num_tokens: int) -> SequenceKV:
        if not self.can_reserve(seq_id, num_tokens):
            raise KVCapacityError(f"KV store full: {self.used_bytes} of {self.capacity_bytes} bytes used")
        seq = self._seqs.get(seq_id) or self._seqs.setdefault(
            seq_id, SequenceKV(self.cfg, self.dtype, self.chunk_tokens, self.num_kv_heads, self.device))
        self.used_bytes += seq.reserve(num_tokens)
        return seq

    def get(self, seq_id: str) -> SequenceKV:
        return self._seqs[seq_id]

    def adopt(self, seq_id: str, seq: SequenceKV) -> None:
        """Hold a sequence reserved in another store, as it is (a prefill worker's prompt
        computed in chunks keeps its KV from one forward's store to the next)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already held here")
        if self.used_bytes + seq.nbytes() > self.capacity_bytes:
            raise KVCapacityError(f"KV store full: {self.used_bytes} of {self.capacity_bytes} bytes used")
        self._seqs[seq_id] = seq
        self.used_bytes += seq.nbytes()

    def free(self, seq_id: str) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self.used_bytes -= seq.nbytes()

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self._seqs.values())
