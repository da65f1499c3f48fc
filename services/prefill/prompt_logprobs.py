"""Which rows of a prefill forward to score, when some prompts want their own tokens'
logprobs (completions' `echo` with `logprobs`): every position of those prompts, the
last position of the others. A pure function of the batch's shape."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def logit_rows(query_lens: Sequence[int], wants: Sequence[bool]) -> tuple[torch.Tensor, list[int], list[list[int]]]:
    """query_lens: each sequence's new tokens in the step (token-major); wants: whether it
    wants its prompt's logprobs (then all its prompt is new: no prefix-cache hit).

    Returns (logits_index [R] rows of the step's tokens to score; per sequence, the row of
    the logits that samples its first output; per sequence, the rows that score prompt
    tokens 1.. in order, empty unless wanted). Row r scores the token after position r."""
    index: list[int] = []
    last: list[int] = []
    prompt_rows: list[list[int]] = []
    start = 0
    for n, want in zip(query_lens, wants):
        first = len(index)
        if want:
            index.extend(range(start, start + n))
            prompt_rows.append(list(range(first, first + n - 1)))
        else:
            index.append(start + n - 1)
            prompt_rows.append([])
        last.append(len(index) - 1)
        start += n
    return torch.tensor(index, dtype=torch.long), last, prompt_rows
