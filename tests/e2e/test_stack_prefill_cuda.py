"""The prefill worker on a GPU (prefill.device: cuda): greedy outputs equal transformers'
while prompts hit a shared prefix held in the prefix cache's device tier (GPU memory)
and, pushed down by a long prompt, in its host tier (pinned CPU memory); the KV still
reaches the CPU attention workers. Runs only where CUDA is present."""

from __future__ import annotations

import asyncio

import pytest
import torch
from e2e_helpers import complete, service_metric, start_stack, until

from lamina.kvstore.block_hash import block_hashes
from lamina.kvstore.metadata import MetadataConfig, MetadataStore
from lamina.kvstore.tiers import Tier
from lamina.model.checkpoints import load_config
from lamina.services.config import PrefillSection

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)"),
              pytest.mark.timeout(600)]

BLOCK_TOKENS = 16
MAX_TOKENS = 8
SHARED = ("You are a meticulous museum guide. You answer in one short sentence, you never invent dates, "
          "and you always name the room where an object is kept. ") * 2
QUESTIONS = ["Where is the oldest vase?", "Which room holds the armour?", "Who painted the ceiling?"]
FILLER = "The following is a transcript of a cooking class about bread, butter and patience. " * 8


def _hf(hf, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(ids):].tolist()


def test_prefill_on_the_gpu_hits_device_and_host_tiers_and_matches_transformers(loaded_model, hf_reference):
    tok = loaded_model.tokenizer
    first, second, third = (tok.encode(SHARED + q) for q in QUESTIONS)
    filler = tok.encode(FILLER)
    cfg = load_config(None)
    block_bytes = cfg.num_layers * 2 * BLOCK_TOKENS * cfg.num_kv_heads * cfg.head_dim * 4  # float32
    shared_blocks = len(tok.encode(SHARED)) // BLOCK_TOKENS
    assert shared_blocks >= 3 and len(filler) // BLOCK_TOKENS > shared_blocks + 2
    # The device tier holds the shared prefix and a question, not the filler as well.
    # float32 on the GPU too (its default is bfloat16): transformers' float32 tokens are the check.
    section = PrefillSection(device="cuda", dtype="float32", cache_block_tokens=BLOCK_TOKENS,
                             cache_device_bytes=(shared_blocks + 2) * block_bytes, cache_host_bytes=64 * block_bytes)
    stack = start_stack(workers=1, micro_batches=1, prefill=section)
    try:
        def cached() -> float:
            return service_metric(stack, "prefill", "prefill-0", "lamina_prefill_cached_tokens_total")

        assert complete(stack, first, MAX_TOKENS)["choices"][0]["text"] == tok.decode(_hf(hf_reference, first))
        assert cached() == 0
        # The shared blocks from GPU memory.
        assert complete(stack, second, MAX_TOKENS)["choices"][0]["text"] == tok.decode(_hf(hf_reference, second))
        from_device = cached()
        assert from_device >= shared_blocks * BLOCK_TOKENS
        # The filler pushes them to the pinned host tier (as the store's block records show);
        # the third prompt reads them from there.
        assert complete(stack, filler, MAX_TOKENS)["choices"][0]["text"] == tok.decode(_hf(hf_reference, filler))
        first_block = block_hashes(first, BLOCK_TOKENS)[0]
        assert asyncio.run(_tier_of(stack, first_block)) == Tier.HOST
        assert complete(stack, third, MAX_TOKENS)["choices"][0]["text"] == tok.decode(_hf(hf_reference, third))
        assert cached() - from_device >= shared_blocks * BLOCK_TOKENS
    finally:
        stack.stop()


async def _tier_of(stack, block_hash: str) -> int:
    """The tier prefill-0's block record gives `block_hash`, once the store shows it off the device tier."""
    async with MetadataStore(MetadataConfig(url=stack.config.redis_url, namespace=stack.config.namespace)) as store:
        async def moved():
            records = {r.block_hash: r for r in await store.node_blocks("prefill-0")}
            record = records.get(block_hash)
            return record is not None and record.tier != Tier.DEVICE and record.tier
        return await until(moved)
