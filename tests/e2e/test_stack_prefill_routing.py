"""Two prefill workers (issue 12): prompts that share a long prefix, sent one after
another, go to the worker whose prefix cache holds it (seen in its block records in the
metadata store and in each worker's Prometheus counters), a prompt sharing nothing goes
to the other one, and every greedy output equals transformers'.

The stack (shared_stacks.PREFILL_ROUTING) serves this test first, as it started, and then
the transport matrix's row of head partitioning over one attention worker; its pool
checks, when it stops it, that its configuration (with the token) and logs went with it."""

from __future__ import annotations

import asyncio

import pytest
import torch
from e2e_helpers import complete, service_metric
from shared_stacks import PREFILL_ROUTING

from lamina.kvstore.block_hash import block_hashes
from lamina.kvstore.metadata import MetadataConfig, MetadataStore
from lamina.services.cluster_status import read_status

pytestmark = pytest.mark.timeout(300)

BLOCK_TOKENS = 16  # PrefillSection's default cache_block_tokens
MAX_TOKENS = 6
SHARED_X = ("You are a meticulous museum guide. You answer in one short sentence, you never invent dates, "
            "and you always name the room where an object is kept. ") * 3
SHARED_Y = ("The following is a transcript of a cooking class. The chef explains each step slowly, lists the "
            "ingredients first, and warns about anything hot. ") * 3
# (shared prefix, question, the worker prefix routing sends it to). Round robin would send
# the last two to prefill-1 and prefill-0.
CASES = [(SHARED_X, "Where is the oldest vase?", "prefill-0"),  # nothing cached: the lowest index
         (SHARED_Y, "What do we cook first?", "prefill-1"),  # nothing cached: the worker chosen least recently
         (SHARED_X, "Which room holds the armour?", "prefill-0"),
         (SHARED_X, "Who painted the ceiling?", "prefill-0"),
         (SHARED_Y, "How hot is the oven?", "prefill-1")]


@pytest.mark.stack(PREFILL_ROUTING, first=True)  # nothing cached, no worker chosen yet
def test_prompts_sharing_a_prefix_go_to_the_worker_holding_it(stack, loaded_model, hf_reference):
    tok = loaded_model.tokenizer
    prompts = [tok.encode(shared + question) for shared, question, _ in CASES]
    assert min(len(p) for p in prompts) > 4 * BLOCK_TOKENS
    references = []
    for ids in prompts:
        with torch.no_grad():
            gen = hf_reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                        max_new_tokens=MAX_TOKENS, do_sample=False)
        references.append(tok.decode(gen[0, len(ids):].tolist()))

    asyncio.run(_check(stack, prompts, references))
    _check_counters(stack, prompts)


async def _check(stack, prompts: list[list[int]], references: list[str]) -> None:
    async with MetadataStore(MetadataConfig(url=stack.config.redis_url, namespace=stack.config.namespace)) as store:
        for (_, _, worker), prompt, reference in zip(CASES, prompts, references):
            result = await asyncio.to_thread(complete, stack, prompt, MAX_TOKENS)
            assert result["choices"][0]["text"] == reference
            # The worker cached the prompt's blocks and published them: the next prompt's route sees them.
            await _until_blocks_on(store, worker, block_hashes(prompt, BLOCK_TOKENS))
        status = await read_status(stack.config)
    assert [c.name for c in status.prefix_cache] == ["prefill-0", "prefill-1"]
    assert all(s.healthy for s in status.services)


def _check_counters(stack, prompts: list[list[int]]) -> None:
    workers = ("prefill-0", "prefill-1")
    requests = {w: service_metric(stack, "prefill", w, "lamina_prefill_requests_total") for w in workers}
    cached = {w: service_metric(stack, "prefill", w, "lamina_prefill_cached_tokens_total") for w in workers}
    assert requests == {"prefill-0": 3, "prefill-1": 2}
    x_blocks = len(_common(prompts[0], prompts[2])) // BLOCK_TOKENS * BLOCK_TOKENS
    y_blocks = len(_common(prompts[1], prompts[4])) // BLOCK_TOKENS * BLOCK_TOKENS
    # Each later prompt of a prefix read at least its full shared blocks from that worker's cache.
    assert cached["prefill-0"] >= 2 * x_blocks and cached["prefill-1"] >= y_blocks > 0


def _common(a: list[int], b: list[int]) -> list[int]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


async def _until_blocks_on(store: MetadataStore, node: str, hashes: list[str], timeout_s: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with store.subscribe() as events:
        while not set(hashes) <= await store.blocks_on(node):
            assert loop.time() < deadline, f"{node} does not hold the prompt's blocks"
            await events.next_event(timeout_s=0.2)
