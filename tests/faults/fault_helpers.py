"""What the fault tests share: the prompts, and streaming them all while something is killed."""

from __future__ import annotations

import asyncio

import openai

PROMPTS = ["What is the capital of France?", "Name two colours of the rainbow.", "Why is the sky blue?",
           "Give me a word that rhymes with cat.", "What do bees make?", "How many legs does a spider have?",
           "Say hello in Spanish.", "What is two plus two?"]
MAX_TOKENS = 40


def pid(stack, name: str) -> int:
    (sp,) = [sp for sp in stack.processes if sp.name == name]
    return sp.proc.pid


async def stream_all(base_url: str, kill, after_chunks: int | None, errors: bool = False) -> list:
    """Stream every prompt at once; call `kill()` once every stream has `after_chunks`
    content chunks (None: right after sending). Returns each stream's text (with
    `errors`, a stream that fails gives its exception instead)."""
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
        return await asyncio.gather(*tasks, return_exceptions=errors)
    finally:
        await client.close()
