"""The metadata store as the stack's memory (issue 12): after requests that share
prefixes, the prefill worker's prefix-cache blocks in Redis equal its cache (replayed
here on a local PrefixCache fed the same prompts in the same order) through inserts,
demotions to host, promotions and drops; placements carry their token counts while
requests run and are gone when they end; `lamina status --json` shows both; a prefill
worker that stops withdraws its blocks."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import pytest
import torch
from e2e_helpers import attention_stats, complete, start_stack, until

from lamina.kvstore.metadata import MetadataConfig, MetadataStore
from lamina.kvstore.prefix_cache import PrefixCache, PrefixCacheConfig
from lamina.model.checkpoints import load_config
from lamina.services.config import PrefillSection

pytestmark = pytest.mark.timeout(300)

BLOCK_TOKENS = 16
DEVICE_BLOCKS, HOST_BLOCKS = 4, 4


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="needs a CUDA device (none on this machine)"))])
def test_blocks_and_placements_in_the_store(device):
    # cuda: the prefill worker computes on the GPU; its device tier is GPU memory, its host tier pinned.
    cfg = load_config(None)
    block_bytes = cfg.num_layers * 2 * BLOCK_TOKENS * cfg.num_kv_heads * cfg.head_dim * 4  # float32
    # float32 on the GPU too (its default is bfloat16): the blocks' bytes are counted in float32.
    section = PrefillSection(device=device, dtype="float32", cache_block_tokens=BLOCK_TOKENS,
                             cache_device_bytes=DEVICE_BLOCKS * block_bytes, cache_host_bytes=HOST_BLOCKS * block_bytes)
    stack = start_stack(workers=1, micro_batches=1, prefill=section)
    try:
        asyncio.run(_check(stack, cfg, section))
    finally:
        stack.stop()


async def _check(stack, cfg, section: PrefillSection) -> None:
    replica = PrefixCache(PrefixCacheConfig(block_size=section.cache_block_tokens,
                                            device_bytes=section.cache_device_bytes,
                                            host_bytes=section.cache_host_bytes, eviction=section.cache_eviction))
    shared = [1000 + i for i in range(3 * BLOCK_TOKENS)]
    prompts = [shared + [2000 + i for i in range(BLOCK_TOKENS + 5)],
               shared + [3000 + i for i in range(BLOCK_TOKENS + 3)],
               [4000 + i for i in range(4 * BLOCK_TOKENS + 1)],  # pushes the shared blocks to host
               shared + [2000 + i for i in range(BLOCK_TOKENS + 7)],  # hits them there: promoted
               [5000 + i for i in range(5 * BLOCK_TOKENS + 2)]]  # more than both tiers: drops
    store = MetadataStore(MetadataConfig(url=stack.config.redis_url, namespace=stack.config.namespace))
    try:
        for p in prompts:  # one at a time: the worker's cache sees them in this order
            complete(stack, p, max_tokens=2)
            with replica.acquire(p[:-1]):  # what the prefill worker does: the prefix, then the prompt
                pass
            replica.insert(p, torch.zeros(cfg.num_layers, 2, len(p), cfg.num_kv_heads, cfg.head_dim))
        assert replica.stats.num_dropped > 0 and replica.stats.num_demotions["host"] > 0
        assert sum(replica.stats.num_promotions.values()) > 0
        want = {i.block_hash: (int(i.tier), i.num_bytes, i.parent_hash, i.num_tokens) for i in replica.block_infos()}

        async def store_equals_cache():
            got = {r.block_hash: (r.tier, r.num_bytes, r.parent_hash, r.num_tokens)
                   for r in await store.node_blocks("prefill-0")}
            return got == want

        await until(store_equals_cache)
        for h in want:
            assert set(await store.get_block(h)) == {"prefill-0"}

        # A longer request: its placement names its worker and grows; it is gone at the end.
        # 96 tokens whatever the model says (placements are written every 0.5 s: a decode
        # that ends at an early EOS, or within one period, would never be seen growing).
        prompt = [6000 + i for i in range(40)]
        done = threading.Event()
        thread = threading.Thread(target=lambda: (complete(stack, prompt, max_tokens=96, ignore_eos=True),
                                                  done.set()))
        thread.start()

        async def growing_placement():
            for rid in await store.placed_requests():
                p = await store.get_placement(rid)
                if p is not None and p.tokens and min(p.tokens.values()) > len(prompt):
                    return p
            return None

        placement = await until(growing_placement, timeout_s=60)
        (worker,) = placement.workers
        assert set(placement.tokens) == {worker}
        (stats,) = await attention_stats(stack)
        assert worker == "attention-0" and stats.num_tokens >= placement.tokens[worker]  # it lags, never leads
        thread.join(120)
        assert done.is_set()

        async def no_placements():
            return not await store.placed_requests()

        await until(no_placements)

        async def attention_idle():
            figures = [await store.get_stats("attention", f"attention-{i}") for i in range(1)]
            return all(f and f["used_tokens"] == 0 and f["sequences"] == 0 and f["capacity_tokens"] > 0
                       for f in figures)

        await until(attention_idle)
        prompt_tokens = sum(len(p) for p in prompts) + len(prompt)

        async def prefill_figures():
            f = await store.get_stats("prefill", "prefill-0")
            return f if f and f["prompt_tokens"] == prompt_tokens else None

        figures = await until(prefill_figures)
    finally:
        await store.close()
    assert figures["hit_tokens"] == replica.stats.num_hit_tokens > 0

    # In a thread: the command reads the gateway this event loop's stack serves.
    result = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "lamina.cli", "status", "--json", "--port",
                         str(stack.config.gateway.port)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    (cache,) = status["prefix_cache"]
    tiers = {t: {"blocks": 0, "bytes": 0} for t in ("device", "host", "disk")}
    for i in replica.block_infos():
        tiers[i.tier.name.lower()]["blocks"] += 1
        tiers[i.tier.name.lower()]["bytes"] += i.num_bytes
    assert cache == {"name": "prefill-0", "tiers": tiers, "hit_tokens": figures["hit_tokens"],
                     "prompt_tokens": prompt_tokens, "fetched_tokens": 0}
    for a in status["attention"]:
        assert (a["used_tokens"], a["sequences"]) == (0, 0) and a["capacity_tokens"] > 0

    # A prefill worker that stops takes its blocks out of the store.
    (prefill,) = [sp for sp in stack.processes if sp.name == "prefill-0"]
    prefill.proc.terminate()
    assert await asyncio.to_thread(prefill.proc.wait, 60) == 0
    await _assert_no_blocks(stack)


async def _assert_no_blocks(stack) -> None:
    async with MetadataStore(MetadataConfig(url=stack.config.redis_url, namespace=stack.config.namespace)) as store:
        assert await store.node_blocks("prefill-0") == []
