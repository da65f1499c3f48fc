"""The prefill worker's prefetcher (`prefill.prefetch`): the real model, a real prefix cache
whose device tier holds fewer blocks than the prompts want, and a real attention worker's
data-plane handler over TCP, without processes or Redis (no Redis call is made here).

Prompt a (three new blocks) is prefilled while prompt b waits; b's two cached blocks are on
host. With prefetch on, they move to device while a computes (filling it) and a's prefill
(whose insert wants more than the whole device tier) leaves them there, so b's prefill
finds them on device; with it off, b's prefill finds them on host."""

from __future__ import annotations

import asyncio
import threading

import pytest
from prefill_helpers import serving_prefill

from lamina.kvstore.block_hash import block_hashes
from lamina.kvstore.tiers import Tier
from lamina.model.checkpoints import load_config as load_model_config
from lamina.services.attention.attention_service import AttentionService
from lamina.services.config import AttentionSection, ConfigError, PrefillSection, StackConfig, load_config
from lamina.services.prefill.prefill_service import PrefillService
from lamina.services.protos import lamina_pb2

pytestmark = pytest.mark.timeout(300)

BS = 16  # cache block (tokens)
SHARED = list(range(1000, 1000 + 2 * BS))  # b's cached prefix: two blocks


def test_prefetch_is_on_unless_set_off():
    assert load_config(env={}).prefill.prefetch is True
    assert load_config(env={"LAMINA_PREFILL_PREFETCH": "false"}).prefill.prefetch is False
    assert load_config(env={}, overrides={"prefill.prefetch": False}).prefill.prefetch is False
    with pytest.raises(ConfigError, match=r"prefill\.prefetch must be true or false"):
        load_config(env={"LAMINA_PREFILL_PREFETCH": "sometimes"})


def _request(seq_id: str, token_ids: list[int]) -> lamina_pb2.PrefillRequest:
    return lamina_pb2.PrefillRequest(seq_id=seq_id, token_ids=token_ids, params=lamina_pb2.SamplingParams(max_tokens=1),
                                     placement=lamina_pb2.Placement(workers=[0]))


async def _a_then_b(prefetch: bool) -> dict:
    block_bytes = BS * load_model_config(None).kv_bytes_per_token()
    # Device: two blocks (b's prefix fills it; a's insert wants three); host: everything.
    config = StackConfig(redis_url="redis://127.0.0.1:1", prefill=PrefillSection(
        cache_block_tokens=BS, cache_device_bytes=2 * block_bytes, cache_host_bytes=16 * block_bytes,
        max_batch_tokens=3 * BS + 1, prefetch=prefetch),
        attention=AttentionSection(workers=1, kv_capacity_bytes=64 << 20))
    svc = PrefillService(config)
    cache = svc.cache
    assert cache is not None and (svc.prefetcher is not None) == prefetch
    attention = AttentionService(config)
    batches: list[list[str]] = []
    on_device_before_a_computes: list[bool] = []
    runs = []
    ran = threading.Event()
    if svc.prefetcher is not None:
        run = svc.prefetcher.run

        def recorded_run(upcoming, stop=None):
            result = run(upcoming, stop)
            runs.append(([key for key, _ in upcoming], result))
            ran.set()
            return result

        svc.prefetcher.run = recorded_run  # type: ignore[method-assign]
    forward = svc._forward

    async def forward_after_prefetch(kv, prompts):
        batches.append([p.seq_id for p in prompts])
        if batches[-1] == ["a"]:
            if prefetch:  # a forward long enough for the run (this one may be quicker on a fast machine)
                assert await asyncio.to_thread(ran.wait, 60), "no prefetch run while a computed"
            on_device_before_a_computes.append(cache.tier_distance(SHARED) == Tier.DEVICE)
        return await forward(kv, prompts)

    svc._forward = forward_after_prefetch  # type: ignore[method-assign]
    async with serving_prefill(svc, attention):
        await svc.prefill(_request("w", SHARED + [2000, 2001, 2002]))  # caches b's prefix on device
        await svc.prefill(_request("f", list(range(3000, 3000 + 3 * BS + 1))))  # pushes it to host
        assert cache.tier_distance(SHARED) == Tier.HOST
        before = dict(cache.stats.hit_tokens_by_tier)
        a = _request("a", list(range(4000, 4000 + 3 * BS + 1)))
        b = _request("b", SHARED + [5000, 5001, 5002, 5003])
        result_a, result_b = await asyncio.gather(svc.prefill(a), svc.prefill(b))
    assert batches[-2:] == [["a"], ["b"]]  # b did not fit a's forward: it waited
    hits = {tier: n - before[tier] for tier, n in cache.stats.hit_tokens_by_tier.items()}
    prefetched = svc.runtime.registry.get_sample_value("lamina_prefill_prefetched_blocks_total")
    return {"hits": hits, "cached_b": result_b.cached_tokens, "tokens": (result_a.token_id, result_b.token_id),
            "runs": [(keys == [id(b)], r.num_promoted) for keys, r in runs], "prefetched": prefetched,
            "on_device_before_a_computes": on_device_before_a_computes,
            "figures": {k: svc.stats()[k] for k in ("prefetched_blocks", "hit_tokens_by_tier")},
            "a_cached": cache.lookup(list(a.token_ids)).num_tokens,
            "protected": [cache.is_protected(h) for h in block_hashes(SHARED, BS)],
            "requests_held": svc.prefetcher.num_requests if svc.prefetcher is not None else 0}


async def test_a_waiting_prompts_prefix_is_on_device_for_its_prefill_only_with_prefetch():
    on = await _a_then_b(prefetch=True)
    off = await _a_then_b(prefetch=False)
    # On: one run, over b alone (a was taken), moved b's two blocks up before a computed, and
    # a's prefill (inserting three blocks in a two-block device tier) left them there.
    assert on["runs"] == [(True, 2)] and on["prefetched"] == 2 and on["figures"]["prefetched_blocks"] == 2
    assert on["on_device_before_a_computes"] == [True]
    assert on["hits"] == {"device": 2 * BS, "host": 0, "disk": 0}
    # Off: nothing moved ahead; b's prefill brought its prefix up from host itself.
    assert off["runs"] == [] and off["prefetched"] == 0 and off["figures"]["prefetched_blocks"] == 0
    assert off["on_device_before_a_computes"] == [False]
    assert off["hits"] == {"device": 0, "host": 2 * BS, "disk": 0}
    for r in (on, off):
        assert r["cached_b"] == 2 * BS
        assert r["a_cached"] == 3 * BS  # on: a's blocks went to host, the device held only b's
        assert r["figures"]["hit_tokens_by_tier"]["host"] == r["hits"]["host"]  # none before a and b
        assert r["protected"] == [False, False] and r["requests_held"] == 0  # released once b took them
    assert on["tokens"] == off["tokens"]  # where the prefix was changes no output
