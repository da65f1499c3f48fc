"""Greedy identity with transformers for every transport, worker count and partitioning."""

from __future__ import annotations

import openai
import pytest

import transports
from e2e_helpers import CHAT_PROMPTS, COMPLETION_PROMPTS, MAX_TOKENS, start_stack

MATRIX = [(t, w, p) for t in ("tcp", "shm", "ucx") for w in (1, 2) for p in ("request", "head")]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("transport", "workers", "partition"), MATRIX,
                         ids=[f"{t}-{w}w-{p}" for t, w, p in MATRIX])
def test_greedy_identity(transport, workers, partition, reference_outputs):
    missing = transports.availability(transport)
    if missing:
        pytest.skip(f"{transport} transport unavailable on this machine: {missing}")
    stack = start_stack(transport=transport, partition=partition, workers=workers)
    try:
        client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        p = CHAT_PROMPTS[0]
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": p}],
                                           max_tokens=MAX_TOKENS, temperature=0, extra_body={"return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == reference_outputs[("chat", p)]["token_ids"]
        assert r.choices[0].message.content == reference_outputs[("chat", p)]["text"]
        p = COMPLETION_PROMPTS[1]
        r = client.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == reference_outputs[("completion", p)]["token_ids"]
        assert r.choices[0].text == reference_outputs[("completion", p)]["text"]
    finally:
        stack.stop()
