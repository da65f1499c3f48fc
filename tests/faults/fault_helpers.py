"""What the fault tests share: the prompts, streaming them all while something is killed,
and the stack of those that kill nothing."""

from __future__ import annotations

import asyncio

from shared_stacks import StackSpec

# The stack the tests that kill nothing share (tcp, one attention worker): the cluster
# token's checks (test_auth_stack.py), hostile frames (test_fuzz_frames.py) and hostile
# HTTP (test_fuzz_http.py). Each checks that every process is still alive.
ONE_WORKER = StackSpec(workers=1)

PROMPTS = ["What is the capital of France?", "Name two colours of the rainbow.", "Why is the sky blue?",
           "Give me a word that rhymes with cat.", "What do bees make?", "How many legs does a spider have?",
           "Say hello in Spanish.", "What is two plus two?"]
MAX_TOKENS = 40


def greedy_references(loaded_model, hf_reference) -> list[str]:
    """transformers' greedy continuations of PROMPTS as chat, decoded."""
    import torch

    tok = loaded_model.tokenizer
    out = []
    for p in PROMPTS:
        ids = tok.encode_chat([{"role": "user", "content": p}])
        with torch.no_grad():
            gen = hf_reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                        max_new_tokens=MAX_TOKENS, do_sample=False)
        out.append(tok.decode(gen[0, len(ids):].tolist()))
    return out


def pid(stack, name: str) -> int:
    (sp,) = [sp for sp in stack.processes if sp.name == name]
    return sp.proc.pid


async def stream_all(base_url: str, kill, after_chunks: int | None, errors: bool = False,
                     api_key: str = "unused") -> list:
    """Stream every prompt at once; call `kill()` once every stream has `after_chunks`
    content chunks (None: right after sending). Returns each stream's text (with
    `errors`, a stream that fails gives its exception instead)."""
    import openai  # here: a GPU machine's image may lack a working openai, and only this needs it

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=300)
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
