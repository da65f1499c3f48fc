"""Which rows a prefill forward scores when some prompts want their own tokens' logprobs."""

from __future__ import annotations

from lamina.services.prefill.prompt_logprobs import logit_rows


def test_only_the_last_row_of_prompts_that_do_not_ask():
    index, last, prompt_rows = logit_rows([3, 2], [False, False])
    assert index.tolist() == [2, 4] and last == [0, 1] and prompt_rows == [[], []]


def test_every_row_of_a_prompt_that_asks():
    # tokens: a0 a1 a2 | b0 b1 b2 b3 | c0 c1
    index, last, prompt_rows = logit_rows([3, 4, 2], [False, True, False])
    assert index.tolist() == [2, 3, 4, 5, 6, 8]
    assert last == [0, 4, 5]  # b's last row samples its first output
    assert prompt_rows == [[], [1, 2, 3], []]  # rows of b0, b1, b2 score b1, b2, b3
