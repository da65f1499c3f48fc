"""Worker failures survived with identical output (docs/reliability.md).

Eight greedy requests stream through a real stack while a worker process is killed
with SIGKILL; every stream must go on without an error and end with exactly the text
of transformers' greedy continuation: no token repeated, none missing."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import openai
import pytest
import torch
from e2e_helpers import start_stack

from kvstore.metadata import MetadataConfig, MetadataStore
from services.config import DeadlinesSection

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


async def _stream_all(base_url: str, kill, after_chunks: int | None, errors: bool = False) -> list:
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


def test_a_stopped_worker_is_failed_over_within_the_reply_deadline(references):
    """SIGSTOP: the worker is alive but answers nothing. Its requests move to the other
    worker once `deadlines.reply_s` passes, and still end with the right text."""
    stack = start_stack(workers=2, partition="request", deadlines=DeadlinesSection(reply_s=3.0, health_s=1.0))
    pid = _pid(stack, "attention-0")
    try:
        start = time.monotonic()
        texts = asyncio.run(_stream_all(stack.base_url, lambda: os.kill(pid, signal.SIGSTOP), 3))
        assert texts == references
        assert time.monotonic() - start < 120
    finally:
        os.kill(pid, signal.SIGCONT)
        stack.stop()


def test_a_hung_model_worker_is_replaced_by_another(references):
    """SIGSTOP a model worker mid-decode: after `deadlines.step_s` without a step result
    its requests are rebuilt and join the other model worker. When it resumes, frames
    of its interrupted step address the old KV ids and change nothing."""
    stack = start_stack(model_workers=2, deadlines=DeadlinesSection(step_s=4.0, health_s=1.0))
    pid = _pid(stack, "model-0")
    try:
        texts = asyncio.run(_stream_all(stack.base_url, lambda: os.kill(pid, signal.SIGSTOP), 3))
        assert texts == references
        os.kill(pid, signal.SIGCONT)
        assert asyncio.run(_stream_all(stack.base_url, lambda: None, None)) == references
    finally:
        os.kill(pid, signal.SIGCONT)
        stack.stop()


def test_requests_end_with_a_clear_error_when_no_placement_is_left():
    """Head-level partitioning needs every worker: with one stopped, the requests end
    with an error naming the cause once the recovery deadline passes (no hang)."""
    d = DeadlinesSection(reply_s=2.0, health_s=1.0, recovery_s=4.0)
    stack = start_stack(workers=2, partition="head", deadlines=d)
    pid = _pid(stack, "attention-1")
    try:
        start = time.monotonic()
        outcomes = asyncio.run(_stream_all(stack.base_url, lambda: os.kill(pid, signal.SIGSTOP), 2, errors=True))
        elapsed = time.monotonic() - start
        assert all(isinstance(o, openai.APIError) for o in outcomes), outcomes
        assert all("attention worker" in str(o) for o in outcomes), outcomes
        assert elapsed < 60
    finally:
        os.kill(pid, signal.SIGCONT)
        stack.stop()


def test_seeded_samples_are_the_same_with_and_without_a_failure():
    stack = start_stack(workers=2, partition="request")
    try:
        async def sample_all() -> list[str]:
            client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
            model = (await client.models.list()).data[0].id
            try:
                outs = await asyncio.gather(*(client.completions.create(
                    model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.95, seed=100 + i,
                    extra_body={"ignore_eos": True, "return_token_ids": True}) for i, p in enumerate(PROMPTS[:4])))
            finally:
                await client.close()
            return [o.choices[0].model_extra["token_ids"] for o in outs]

        clean = asyncio.run(sample_all())
        pid = _pid(stack, "attention-0")

        async def with_kill() -> list[str]:
            task = asyncio.create_task(sample_all())
            await asyncio.sleep(1.5)  # prefilled and decoding (each sample is 40 tokens)
            os.kill(pid, signal.SIGKILL)
            return await task

        assert asyncio.run(with_kill()) == clean
    finally:
        stack.stop()


def test_redis_restarted_mid_run(references):
    """The metadata store restarts empty: requests in flight go on, every service
    registers again, running requests' placements and journal are written again, and
    once they end nothing is left behind."""
    stack = start_stack(workers=2, partition="request")
    try:
        texts = asyncio.run(_stream_all(stack.base_url, stack.redis.restart, 3))
        assert texts == references

        async def settled() -> tuple[dict, set, list]:
            store = MetadataStore(MetadataConfig(url=stack.config.redis_url, namespace=stack.config.namespace))
            try:
                deadline = time.monotonic() + 30
                while True:  # heartbeats re-register; frees and journal batches land
                    kinds = {k: len(await store.list_services(k))
                             for k in ("attention", "model", "prefill", "scheduler", "gateway")}
                    placed, journal = await store.placed_requests(), await store.read_journal()
                    if (sum(kinds.values()) == 6 and not placed and not journal) or time.monotonic() > deadline:
                        return kinds, placed, journal
                    await asyncio.sleep(0.5)
            finally:
                await store.close()

        kinds, placed, journal = asyncio.run(settled())
        assert kinds == {"attention": 2, "model": 1, "prefill": 1, "scheduler": 1, "gateway": 1}
        assert placed == set() and journal == []
        again = asyncio.run(_stream_all(stack.base_url, lambda: None, None))
        assert again == references
    finally:
        stack.stop()
