"""What counts as agreeing with a reference at a dtype's precision."""

from __future__ import annotations

import torch


def bfloat16_ties(logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Per row of logits [N, V] (the reference's): whether token `chosen` [N] is the argmax
    or within two bfloat16 steps of the best logit, a tie at bfloat16's precision (8
    significant bits), where two bfloat16 paths may order near-equal logits apart."""
    logits = logits.float()
    best = logits.max(dim=-1).values  # [N]
    step = torch.exp2(torch.floor(torch.log2(best.abs().clamp_min(1e-30))) - 7)  # bfloat16's spacing there
    mine = logits.gather(-1, chosen[:, None].to(logits.device))[:, 0]  # [N]
    return (logits.argmax(-1) == chosen.to(logits.device)) | (mine >= best - 2 * step)
