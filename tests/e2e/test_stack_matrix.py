"""Greedy identity with transformers for every transport, worker count and partitioning.

Every transport runs both partitionings over two attention workers (where frames are
split and gathered); one attention worker is covered over tcp, since the transports'
code does not depend on the worker count. The rows also vary the decode pipeline (1, 2
or 3 micro-batches; Q-early on and off), so every transport carries both the plain and
the Q-early frames; the two requests of a row run at once, so with more than one
micro-batch both are in flight."""

from __future__ import annotations

import asyncio

import openai
import pytest

from lamina import transports
from e2e_helpers import CHAT_PROMPTS, COMPLETION_PROMPTS, MAX_TOKENS, start_stack

MATRIX = [("tcp", 1, "request"), ("tcp", 1, "head")] + \
    [(t, 2, p) for t in ("tcp", "shm", "ucx") for p in ("request", "head")]
# (micro-batches, Q-early) of each row: every transport gets both Q-early settings and,
# over two workers, at least two micro-batch counts.
PIPELINES = [(1, False), (2, True), (3, True), (2, False), (1, True), (3, False), (2, True), (1, False)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("transport", "workers", "partition", "micro_batches", "q_early"),
                         [(*m, *p) for m, p in zip(MATRIX, PIPELINES)],
                         ids=[f"{t}-{w}w-{p}-mb{mb}{'-qearly' if q else ''}"
                              for (t, w, p), (mb, q) in zip(MATRIX, PIPELINES)])
def test_greedy_identity(transport, workers, partition, micro_batches, q_early, reference_outputs):
    missing = transports.availability(transport)
    if missing:
        pytest.skip(f"{transport} transport unavailable on this machine: {missing}")
    stack = start_stack(transport=transport, partition=partition, workers=workers, micro_batches=micro_batches,
                        q_early=q_early)
    try:
        client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)

        async def both():
            model = (await client.models.list()).data[0].id
            return await asyncio.gather(
                client.chat.completions.create(model=model, messages=[{"role": "user", "content": CHAT_PROMPTS[0]}],
                                               max_tokens=MAX_TOKENS, temperature=0,
                                               extra_body={"return_token_ids": True}),
                client.completions.create(model=model, prompt=COMPLETION_PROMPTS[1], max_tokens=MAX_TOKENS,
                                          temperature=0, extra_body={"return_token_ids": True}))

        chat, completion = asyncio.run(both())
        ref = reference_outputs[("chat", CHAT_PROMPTS[0])]
        assert chat.choices[0].model_extra["token_ids"] == ref["token_ids"]
        assert chat.choices[0].message.content == ref["text"]
        ref = reference_outputs[("completion", COMPLETION_PROMPTS[1])]
        assert completion.choices[0].model_extra["token_ids"] == ref["token_ids"]
        assert completion.choices[0].text == ref["text"]
    finally:
        stack.stop()
