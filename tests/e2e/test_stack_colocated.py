"""The colocated layout through the OpenAI API: two model workers, each attending in its
own process on the KV it holds, against transformers.

Both tests share one stack (shared_stacks.COLOCATED); the second reads counters as
differences, so their order does not matter."""

from __future__ import annotations

import asyncio
import itertools
import time

import openai
import pytest
from e2e_helpers import (
    CHAT_PROMPTS,
    COMPLETION_PROMPTS,
    MAX_TOKENS,
    api_key,
    attention_stats,
    metric_total,
    service_metric,
)
from shared_stacks import COLOCATED

from lamina.kvstore.metadata import MetadataConfig, MetadataStore

pytestmark = [pytest.mark.timeout(600), pytest.mark.stack(COLOCATED)]


async def _registered(stack, kind: str) -> dict[str, int]:
    """Service id -> pid of the registered services of `kind`."""
    store = MetadataStore(MetadataConfig(url=stack.config.redis_url, namespace=stack.config.namespace))
    try:
        return {s.service_id: s.meta["pid"] for s in await store.list_services(kind)}
    finally:
        await store.close()


def test_each_model_worker_attends_its_own_sequences_as_transformers(stack, reference_outputs):
    """Four greedy requests at once spread over both model workers; each decodes where its
    KV is, in its own process (no attention worker process runs), and every output equals
    transformers'."""
    assert not [sp for sp in stack.processes if sp.name.startswith("attention")]
    pids = {sp.name: sp.proc.pid for sp in stack.processes}
    assert asyncio.run(_registered(stack, "attention")) == {"attention-0": pids["model-0"],
                                                            "attention-1": pids["model-1"]}
    steps = [service_metric(stack, "model", f"model-{i}", "lamina_model_steps_total") for i in range(2)]
    client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=api_key(stack), max_retries=0)

    async def all_four():
        model = (await client.models.list()).data[0].id
        chats = [client.chat.completions.create(model=model, messages=[{"role": "user", "content": p}],
                                                max_tokens=MAX_TOKENS, temperature=0,
                                                extra_body={"return_token_ids": True}) for p in CHAT_PROMPTS]
        completions = [client.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                                 extra_body={"return_token_ids": True}) for p in COMPLETION_PROMPTS]
        return await asyncio.gather(*chats, *completions)

    results = asyncio.run(all_four())
    for p, r in zip(CHAT_PROMPTS, results[:2]):
        ref = reference_outputs[("chat", p)]
        assert r.choices[0].model_extra["token_ids"] == ref["token_ids"] and r.choices[0].message.content == ref["text"]
    for p, r in zip(COMPLETION_PROMPTS, results[2:]):
        ref = reference_outputs[("completion", p)]
        assert r.choices[0].model_extra["token_ids"] == ref["token_ids"] and r.choices[0].text == ref["text"]
    after = [service_metric(stack, "model", f"model-{i}", "lamina_model_steps_total") for i in range(2)]
    assert all(a > b for a, b in zip(after, steps))  # both model workers decoded some of them
    # The attention ran in the model workers' processes: counted there, and every KV freed.
    for i in range(2):
        assert service_metric(stack, "attention", f"attention-{i}", "lamina_attention_compute_seconds_total") > 0
    assert [s.num_sequences for s in asyncio.run(attention_stats(stack))] == [0, 0]
    # The prefill worker's forwards each took one or two threads (prefill.threads 2), as
    # the cores other processes left.
    forwards = {t: metric_total(stack, "prefill", "prefill-0", f'lamina_prefill_forwards_total{{threads="{t}"}}')
                for t in ("1", "2")}
    assert sum(forwards.values()) >= 1
    assert metric_total(stack, "prefill", "prefill-0", "lamina_prefill_forwards_total") == sum(forwards.values())


def test_choices_fork_and_prefix_hits_on_a_model_workers_own_kv(stack, reference_outputs):
    """n = 2 greedy choices fork the prompt's KV inside the model worker holding it, and a
    repeated prompt read from the prefix cache decodes to the same tokens; streamed, the
    text is the same too."""
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=api_key(stack), max_retries=0)
    model = client.models.list().data[0].id
    p = CHAT_PROMPTS[1]
    ref = reference_outputs[("chat", p)]
    for _ in range(2):  # the second: its prompt's blocks come from the prefix cache
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": p}], n=2,
                                           max_tokens=MAX_TOKENS, temperature=0, extra_body={"return_token_ids": True})
        assert [c.model_extra["token_ids"] for c in r.choices] == [ref["token_ids"]] * 2
    assert r.usage.prompt_tokens_details.cached_tokens > 0
    text = ""
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": p}],
                                                max_tokens=MAX_TOKENS, temperature=0, stream=True):
        text += chunk.choices[0].delta.content or "" if chunk.choices else ""
    assert text == ref["text"]


def test_tokens_stream_as_they_are_decoded(stack):
    """A colocated step waits on no peer; the model worker still sends each step's tokens
    as it makes them, not the whole decode at its end: no gap between two chunks takes
    half the stream."""
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=api_key(stack), max_retries=0)
    model = client.models.list().data[0].id
    arrivals = [time.monotonic() for chunk in client.completions.create(
        model=model, prompt=COMPLETION_PROMPTS[0], max_tokens=32, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if chunk.choices and chunk.choices[0].text]
    assert len(arrivals) >= 24  # (a few tokens may join the next one's text)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert max(gaps) < 0.5 * (arrivals[-1] - arrivals[0]), gaps


def test_a_burst_on_idle_model_workers_starts_decoding_together(stack, reference_outputs):
    """Eight greedy requests at once on idle model workers: the first ones prefilled wait
    for the rest (counted by the scheduler), every worker's sequences join in one update,
    so each worker decodes its share in MAX_TOKENS - 1 steps, and every output still
    equals transformers'."""
    client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=api_key(stack), max_retries=0)
    held = service_metric(stack, "scheduler", "scheduler-0", "lamina_scheduler_held_joins_total")
    steps = [service_metric(stack, "model", f"model-{i}", "lamina_model_steps_total") for i in range(2)]
    prompts = COMPLETION_PROMPTS * 4

    async def burst():
        model = (await client.models.list()).data[0].id
        return await asyncio.gather(*(client.completions.create(
            model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0, extra_body={"return_token_ids": True})
            for p in prompts))

    results = asyncio.run(burst())
    for p, r in zip(prompts, results):
        assert r.choices[0].model_extra["token_ids"] == reference_outputs[("completion", p)]["token_ids"]
    assert service_metric(stack, "scheduler", "scheduler-0", "lamina_scheduler_held_joins_total") > held
    taken = [service_metric(stack, "model", f"model-{i}", "lamina_model_steps_total") - steps[i] for i in range(2)]
    assert taken == [MAX_TOKENS - 1] * 2, taken
