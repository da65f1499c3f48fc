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

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]. Nothing here combines partials, so the
        # fused kernel without lse serves (the per-sequence loop is the engine's
        # main cost after the linears: about 45 us per sequence and layer).
        outs = []
        start = 0
        for seq, n in zip(self._seqs, self._batch.query_lens):
            kk, vv = seq.write(layer_id, k[start : start + n], v[start : start + n])
            outs.append(causal_attention(q[start : start + n], kk, vv))
            start += n
        return outs[0] if len(outs) == 1 else torch.cat(outs)

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
