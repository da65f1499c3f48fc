"""Prefix KV between two prefill workers and across their tiers, through the stack
(issue 12). Routing is forced to round robin, so prompts land on the worker that does
not hold their prefix, and `peer_fetch: always` makes that worker pull the prefix from
the one that does instead of computing it; small device and host tiers push blocks to
host and disk. Every greedy output equals transformers'.

Round robin sends the prompts to prefill-0, prefill-1, prefill-0, ... in order:

    1 -> prefill-0  S + a        computes S; S on its device tier
    2 -> prefill-1  U1           fills prefill-1's device tier
    3 -> prefill-0  U0           fills prefill-0's device tier: S moves to host and disk
    4 -> prefill-1  S + b        S fetched from prefill-0, out of its host and disk tiers
    5 -> prefill-0  U0[:k] + c   U0's first blocks read from its own host and disk tiers

Then prefill-1 is killed (SIGKILL: it withdraws nothing) and its block records leave the
metadata store once its lease has expired, with nobody listing services but the
scheduler's own watch; and prefill-0 is killed and started again: its records are then
exactly what its disk tier kept, on disk.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch
from e2e_helpers import complete, service_metric, start_stack, until

from lamina.kvstore.block_hash import ROOT_HASH, block_hashes
from lamina.kvstore.metadata import MetadataConfig, MetadataStore
from lamina.model.checkpoints import load_config
from lamina.services.config import PrefillSection

pytestmark = pytest.mark.timeout(600)

BLOCK_TOKENS = 16
DEVICE_BLOCKS, HOST_BLOCKS, DISK_BLOCKS = 4, 2, 64
MAX_TOKENS = 5
S = ("A lighthouse keeper writes in his log every evening: the weather, the ships that passed, "
     "the state of the lamp and the oil that is left, and anything strange he saw on the water. ") * 2
U0 = ("The committee met on Tuesday to discuss the budget for the new library. The treasurer presented "
      "three options, each with a different balance between books, computers and longer opening hours, "
      "and the members argued for an hour about which of them the town could afford this year. ") * 2
U1 = ("In the mountains the snow arrives early. Farmers bring their animals down from the high pastures "
      "before the first storm, and the villages prepare firewood, flour and salt for the long winter. ") * 2


def _greedy(model, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="needs a CUDA device (none on this machine)"))])
def test_prefix_fetched_from_a_peer_and_from_lower_tiers(loaded_model, hf_reference, tmp_path, device):
    # cuda: both prefill workers compute on the GPU; a peer reads its blocks from GPU memory,
    # pinned host memory or disk and sends them from CPU memory.
    tok = loaded_model.tokenizer
    s_ids, u0_ids = tok.encode(S), tok.encode(U0)
    # U0 fills the device tier and leaves at least its first two blocks below it.
    assert len(s_ids) >= 3 * BLOCK_TOKENS and len(u0_ids) >= (DEVICE_BLOCKS + 2) * BLOCK_TOKENS
    u0_head = u0_ids[:2 * BLOCK_TOKENS]
    prompts = [s_ids + tok.encode("What did he see on Monday?"), tok.encode(U1), u0_ids,
               s_ids + tok.encode("How much oil was left?"), u0_head + tok.encode(" In the end they chose")]
    references = [tok.decode(_greedy(hf_reference, p)) for p in prompts]

    cfg = load_config(None)
    block_bytes = cfg.num_layers * 2 * BLOCK_TOKENS * cfg.num_kv_heads * cfg.head_dim * 4  # float32
    # float32 on the GPU too (its default is bfloat16): transformers' float32 tokens are the check.
    section = PrefillSection(workers=2, device=device, dtype="float32", routing="round_robin", peer_fetch="always",
                             cache_block_tokens=BLOCK_TOKENS,
                             cache_device_bytes=DEVICE_BLOCKS * block_bytes, cache_host_bytes=HOST_BLOCKS * block_bytes,
                             cache_disk_bytes=DISK_BLOCKS * block_bytes, cache_dir=str(tmp_path / "kv"))
    stack = start_stack(workers=1, micro_batches=1, prefill=section)
    try:
        asyncio.run(_check(stack, prompts, references, s_ids, u0_head))
    finally:
        stack.stop()


def _metric(stack, worker: str, name: str) -> float:
    return service_metric(stack, "prefill", worker, name)


async def _check(stack, prompts, references, s_ids, u0_head) -> None:
    s_blocks = block_hashes(s_ids, BLOCK_TOKENS)[:3]
    u0_blocks = block_hashes(u0_head, BLOCK_TOKENS)
    async with MetadataStore(MetadataConfig(url=stack.config.redis_url, namespace=stack.config.namespace)) as store:
        async def tiers_on(node: str, hashes: list[str]) -> list[int | None]:
            records = {r.block_hash: r.tier for r in await store.node_blocks(node)}
            return [records.get(h) for h in hashes]

        async def run(i: int) -> None:
            result = await asyncio.to_thread(complete, stack, prompts[i], MAX_TOKENS)
            assert result["choices"][0]["text"] == references[i], f"prompt {i + 1}"

        for i in range(3):
            await run(i)
        # Prompt 3 filled prefill-0's device tier: S's blocks went down to host and disk.
        down = await until(lambda: _all_below_device(tiers_on("prefill-0", s_blocks)))
        assert 2 in down, f"S's blocks at prefill-0 by tier: {down}"
        assert await tiers_on("prefill-1", s_blocks) == [None] * 3

        await run(3)  # on prefill-1, which holds no S: fetched from prefill-0's host and disk
        fetched = await asyncio.to_thread(_metric, stack, "prefill-1", "lamina_prefill_fetched_tokens_total")
        computed = await asyncio.to_thread(_metric, stack, "prefill-1", "lamina_prefill_tokens_total")
        assert fetched >= 3 * BLOCK_TOKENS
        assert computed == len(prompts[1]) + len(prompts[3]) - fetched

        # U0's first blocks are below prefill-0's device tier; prompt 5 reads them there.
        assert all(t in (1, 2) for t in await tiers_on("prefill-0", u0_blocks))
        hits_before = await asyncio.to_thread(_metric, stack, "prefill-0", "lamina_prefill_cached_tokens_total")
        await run(4)
        hits = await asyncio.to_thread(_metric, stack, "prefill-0", "lamina_prefill_cached_tokens_total")
        assert hits - hits_before >= len(u0_head)
        assert await asyncio.to_thread(_metric, stack, "prefill-0", "lamina_prefill_fetched_tokens_total") == 0

        # A killed worker's records leave the store when its lease expires.
        assert await store.node_blocks("prefill-1")
        (victim,) = [sp for sp in stack.processes if sp.name == "prefill-1"]
        os.kill(victim.proc.pid, signal.SIGKILL)

        async def records_gone():
            return not await store.node_blocks("prefill-1")

        await until(records_gone, timeout_s=3 * store.config.service_ttl_s)

        # A restarted worker publishes what its disk tier kept: every block it had on disk.
        before = {r.block_hash: r for r in await store.node_blocks("prefill-0")}
        (victim,) = [sp for sp in stack.processes if sp.name == "prefill-0"]
        os.kill(victim.proc.pid, signal.SIGKILL)
        await asyncio.to_thread(victim.proc.wait, 30)
        await asyncio.to_thread(stack.restart, "prefill-0")

        async def republished():
            records = await store.node_blocks("prefill-0")
            service = await store.get_service("prefill", "prefill-0")
            # The new process registers before its first batch replaces the killed one's records.
            fresh = service is not None and service.meta.get("pid") == victim.proc.pid
            return records if fresh and records and all(r.tier == 2 for r in records) else None

        after = await until(republished, timeout_s=120)
        # Back: blocks that were on disk (and those promoted from it, whose disk copy stays)
        # whose every ancestor is back too (a block without its parent is of no use and is
        # deleted when the disk tier is indexed again).
        back = {r.block_hash for r in after}
        assert back <= set(before) and all(r.parent_hash == ROOT_HASH or r.parent_hash in back for r in after)
        on_disk = {h for h, r in before.items() if r.tier == 2}

        def chain_on_disk(h: str) -> bool:
            while h != ROOT_HASH:
                if h not in on_disk:
                    return False
                h = before[h].parent_hash
            return True

        assert {h for h in on_disk if chain_on_disk(h)} <= back


async def _all_below_device(tiers_coro):
    tiers = await tiers_coro
    return tiers if all(t in (1, 2) for t in tiers) else None
