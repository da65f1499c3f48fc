"""A step's batch: the new tokens of every scheduled sequence, token-major.

A whole prompt for a sequence being prefilled, one token for a sequence being
decoded; prefill and decode share the step, and attention is causal per sequence.
The local engine, the prefill worker and the model workers lay out their steps alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepBatch:
    seq_ids: list[str]
    query_lens: list[int]  # new tokens per sequence
    start_positions: list[int]  # tokens already in each sequence's KV
    input_ids: torch.Tensor  # [T] int64, T = sum(query_lens)
    positions: torch.Tensor  # [T] int64
    logits_index: torch.Tensor  # [B] the last new token of each sequence

    @classmethod
    def build(cls, seq_ids: Sequence[str], new_tokens: Sequence[Sequence[int]],
              start_positions: Sequence[int]) -> StepBatch:
        lens = [len(t) for t in new_tokens]
        ids = torch.tensor([t for toks in new_tokens for t in toks], dtype=torch.long)
        pos = torch.cat([torch.arange(s, s + n) for s, n in zip(start_positions, lens)])
        last = torch.tensor(lens).cumsum(0) - 1
        return cls(list(seq_ids), lens, list(start_positions), ids, pos, last)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def model_inputs(self, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """The slices' inputs, on `device` (None or the CPU: where they were built)."""
        inputs = {"input_ids": self.input_ids, "positions": self.positions, "logits_index": self.logits_index}
        if device is None or device.type == "cpu":
            return inputs
        return {name: t.to(device, non_blocking=True) for name, t in inputs.items()}
