"""One forward step of a batch through the split model.

A step batches, token-major, the new tokens of every scheduled sequence: a
whole prompt for a sequence being prefilled, one token for a sequence being
decoded. Prefill and decode share the step; attention is causal per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lamina.engine.kv import KVStore
from model.attention import causal_attention
from model.kv_attention import buffer_attention
from model.splitter import SplitModel


@dataclass(frozen=True)
class StepBatch:
    seq_ids: list[str]
    query_lens: list[int]  # new tokens per sequence
    start_positions: list[int]  # tokens already in each sequence's KV
    input_ids: torch.Tensor  # [T] int64, T = sum(query_lens)
    positions: torch.Tensor  # [T] int64
    logits_index: torch.Tensor  # [B] the last new token of each sequence

    @classmethod
    def build(cls, seq_ids: Sequence[str], new_tokens: Sequence[Sequence[int]], start_positions: Sequence[int]) -> StepBatch:
        lens = [len(t) for t in new_tokens]
        ids = torch.tensor([t for toks in new_tokens for t in toks], dtype=torch.long)
        pos = torch.cat([torch.arange(s, s + n) for s, n in zip(start_positions, lens)])
        last = torch.tensor(lens).cumsum(0) - 1
        return cls(list(seq_ids), lens, list(start_positions), ids, pos, last)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def model_inputs(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids, "positions": self.positions, "logits_index": self.logits_index}


class LocalAttention:
    """Attention over the engine's own KV store (the attention worker's job, in process)."""

    def __init__(self, kv: KVStore, batch: StepBatch) -> None:
        self._kv = kv
        self._batch = batch
        self._seqs = [kv.get(s) for s in batch.seq_ids]
        # The leading sequences that decode one token (the scheduler puts running ones first).
        self._num_decoding = next((i for i, n in enumerate(batch.query_lens) if n != 1), len(batch.query_lens))

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]. Nothing here combines partials, so no lse.
        # Decoding sequences (one new token each) go through one batched kernel call
        # over their buffers in place; a prompt's many causal rows through fused SDPA,
        # whose matmuls beat the kernel's one-pass loop at that size.
        lens = self._batch.query_lens
        keys, values = [], []
        start = 0
        for seq, n in zip(self._seqs, lens):
            kk, vv = seq.write(layer_id, k[start : start + n], v[start : start + n])
            keys.append(kk)
            values.append(vv)
            start += n
        if self._num_decoding == len(lens):
            return buffer_attention(q.contiguous(), lens, keys, values, need_lse=False)[0]
        out = torch.empty_like(q)
        d = self._num_decoding
        if d:
            out[:d] = buffer_attention(q[:d].contiguous(), lens[:d], keys[:d], values[:d], need_lse=False)[0]
        start = d
        for n, kk, vv in zip(lens[d:], keys[d:], values[d:]):
            out[start : start + n] = causal_attention(q[start : start + n], kk, vv)
            start += n
        return out

    def commit(self) -> None:
        for seq, n in zip(self._seqs, self._batch.query_lens):
            seq.length += n


def run_step(split: SplitModel, kv: KVStore, batch: StepBatch) -> torch.Tensor:
    """Run the batch; its new K, V are stored. Returns logits [B, V] float32."""
    attention = LocalAttention(kv, batch)
    with torch.inference_mode():
        logits = split.run(batch.model_inputs(), lambda i, q, k, v: attention.attend(i, q, k, v))
    attention.commit()
    return logits
