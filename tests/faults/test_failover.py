"""Worker failures survived with identical output (docs/reliability.md).

Eight greedy requests stream through a real stack while a worker process is killed
with SIGKILL; every stream must go on without an error and end with exactly the text
of transformers' greedy continuation: no token repeated, none missing."""

from __future__ import annotations

import asyncio
import os
import signal

import openai
import pytest
import torch
from e2e_helpers import start_stack

pytestmark = pytest.mark.timeout(600)

PROMPTS = ["What is the capital of France?", "Name two colours of the rainbow.", "Why is the sky blue?",
           "Give me a word that rhymes with cat.", "What do bees make?", "How many legs does a spider have?",
           "Say hello in Spanish.", "What is two plus two?"]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def references(loaded_model, hf_reference) -> list[str]:
    """transformers' greedy continuations of PROMPTS as chat, decoded."""
    tok = loaded_model.tokenizer
    out = []
    for p in PROMPTS:
        ids = tok.encode_chat([{"role": "user", "content": p}])
        with torch.no_grad():
            gen = hf_reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                        max_new_tokens=MAX_TOKENS, do_sample=False)
        out.append(tok.decode(gen[0, len(ids):].tolist()))
    return out


def _pid(stack, name: str) -> int:
    (sp,) = [sp for sp in stack.processes if sp.name == name]
    return sp.proc.pid


async def _stream_all(base_url: str, kill, after_chunks: int | None) -> list[str]:
    """Stream every prompt at once; call `kill()` once every stream has `after_chunks`
    content chunks (None: right after sending). Returns each stream's text."""
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    model = (await client.models.list()).data[0].id
    counts = [0] * len(PROMPTS)
    ready = asyncio.Event()

    async def one(i: int) -> str:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPTS[i]}], max_tokens=MAX_TOKENS, temperature=0,
            stream=True)
        text = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
                counts[i] += 1
                if after_chunks is not None and min(counts) >= after_chunks:
                    ready.set()
        return "".join(text)

    tasks = [asyncio.create_task(one(i)) for i in range(len(PROMPTS))]
    if after_chunks is None:
        await asyncio.sleep(0.2)
    else:
        await asyncio.wait_for(ready.wait(), 240)
    kill()
    try:
        return await asyncio.gather(*tasks)
    finally:
        await client.close()


# (process killed, when: content chunks every stream has first, None: during prefill, stack options)
CASES = [
    ("attention-0", 3, {"workers": 2, "partition": "request"}),
    ("attention-1", None, {"workers": 2, "partition": "request"}),
    ("model-0", 3, {"model_workers": 2}),
]


@pytest.mark.parametrize(("victim", "after_chunks", "options"), CASES,
                         ids=[f"{v}-{'prefill' if a is None else 'decode'}" for v, a, _ in CASES])
def test_streams_survive_a_killed_worker(victim, after_chunks, options, references):
    stack = start_stack(**options)
    try:
        pid = _pid(stack, victim)
        texts = asyncio.run(_stream_all(stack.base_url, lambda: os.kill(pid, signal.SIGKILL), after_chunks))
        assert texts == references
        # The stack still serves, and nothing is left behind on the attention workers
        # (the killed one, if it was one, is gone: its KV with it).
        assert stack.processes and [sp.name for sp in stack.processes if sp.proc.poll() is not None] == [victim]
    finally:
        stack.stop()
