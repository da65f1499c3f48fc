"""Prefix KV between prefill workers: the fetch policy (lamina.services.scheduler.prefix_fetch_policy) on
hand-checked cases, the FETCH_PREFIX / PREFIX_KV messages, and a real PrefixServer and
PrefixFetcher over a real TCP connection, reading a real prefix cache's tiers."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from lamina import transports
from lamina.kvstore.prefix_cache import PrefixCache, PrefixCacheConfig
from lamina.model.config import ModelConfig
from lamina.services.config import PEER_FETCH_MODES
from lamina.services.prefill.prefix_peers import PrefixFetcher, PrefixServer
from lamina.services.scheduler.prefix_fetch_policy import MODES, plan_fetch
from lamina.services.wire import FetchPrefix, Kind, PrefixKV, RemoteError

BS = 4
L, H, D = 2, 1, 4  # layers, KV heads, head size of these tests


def test_modes_are_the_configs():
    assert MODES == PEER_FETCH_MODES


def test_the_peer_holding_most_is_asked_when_the_transfer_is_faster():
    matched = {"p0": 8, "p1": 32, "p2": 24}
    # p0 chosen; 24 tokens more at p1. 1 KB per token at 1 MB/s: 24 ms + 2 ms against 24 ms
    # of compute at 1,000 tokens/s: compute; at 2,000 tokens/s compute takes 12 ms: compute.
    assert plan_fetch("auto", "p0", matched, {"p1", "p2"}, 1000, 1e6, 1000.0) is None
    # At 10 MB/s the fetch takes 4.4 ms against 24 ms.
    plan = plan_fetch("auto", "p0", matched, {"p1", "p2"}, 1000, 1e7, 1000.0)
    assert (plan.peer, plan.tokens) == ("p1", 32)
    assert plan.fetch_s == pytest.approx(0.002 + 0.0024) and plan.compute_s == pytest.approx(0.024)
    # p1 down: p2's 24 tokens (16 more).
    assert plan_fetch("auto", "p0", matched, {"p2"}, 1000, 1e7, 1000.0).peer == "p2"
    # Nobody holds more than the chosen one, or no compute figure: nothing to fetch.
    assert plan_fetch("auto", "p1", matched, {"p0", "p2"}, 1000, 1e9, 1000.0) is None
    assert plan_fetch("auto", "p0", matched, {"p1"}, 1000, 1e9, None) is None
    # always ignores the figures; off never fetches.
    assert plan_fetch("always", "p0", matched, {"p1"}, 1000, 1.0, None).tokens == 32
    assert plan_fetch("off", "p0", matched, {"p1"}, 1000, 1e12, 1.0) is None
    # Ties go to the first name.
    assert plan_fetch("always", "p0", {"p2": 16, "p1": 16}, {"p1", "p2"}, 1, 1.0, None).peer == "p1"
    with pytest.raises(ValueError, match="unknown peer_fetch mode"):
        plan_fetch("sometimes", "p0", matched, set(), 1, 1.0, None)


def test_messages_round_trip_and_refuse_bad_fields():
    msg = FetchPrefix((3,), [5, 6, 7], 1)
    assert FetchPrefix.from_frame(msg.to_frame()) == msg
    kv = torch.randn(L, 2, 2, H, D)
    back = PrefixKV.from_frame(PrefixKV((3,), 3, kv).to_frame())
    assert back.num_tokens == 3 and torch.equal(back.kv, kv)
    assert PrefixKV.from_frame(PrefixKV((3,), 1, None).to_frame()).kv is None
    bad = msg.to_frame()
    bad.header["start"] = 4
    with pytest.raises(RemoteError, match="outside the 3 tokens"):
        FetchPrefix.from_frame(bad)
    bad.header.update(start=0, tokens=[1, "x"])
    with pytest.raises(RemoteError, match="must be token ids"):
        FetchPrefix.from_frame(bad)


def _cfg() -> ModelConfig:
    return ModelConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_layers=L, num_heads=2,
                       num_kv_heads=H, head_dim=D)


async def test_a_peer_serves_its_prefix_from_every_tier(tmp_path):
    """The peer's cache holds a prompt's blocks on host and disk (device holds one
    block, so nothing could be brought up there); the fetcher gets the KV past what it
    has, equal to what was inserted, and the peer's blocks stay where they were; a
    prompt the peer does not hold gives nothing; a peer that is gone gives nothing and
    the fetcher goes on working."""
    block_bytes = L * 2 * BS * H * D * 4
    cache = PrefixCache(PrefixCacheConfig(block_size=BS, device_bytes=block_bytes, host_bytes=block_bytes,
                                          disk_bytes=8 * block_bytes, disk_dir=str(tmp_path)))
    tokens = list(range(10, 10 + 3 * BS))
    kv = torch.randn(L, 2, len(tokens), H, D)  # [L, 2, T, H, D]
    cache.insert(tokens, kv)
    cache.insert([99] * (2 * BS), torch.randn(L, 2, 2 * BS, H, D))  # pushes the first prompt down
    tiers = {int(i.tier) for i in cache.block_infos()}
    assert {1, 2} <= tiers, tiers
    before = {i.block_hash: i.tier for i in cache.block_infos()}

    server = PrefixServer(cache)
    tcfg = transports.TransportConfig()
    address = await server.start("tcp://127.0.0.1:0", tcfg)  # on a thread and event loop of its own
    fetcher = PrefixFetcher(tcfg, _cfg(), timeout_s=10)
    try:
        n, got = await fetcher.fetch(address, tokens + [1, 2], BS)
        assert n == len(tokens) and torch.equal(got, kv[:, :, BS:])
        assert fetcher.num_fetched_tokens == 2 * BS and fetcher.bytes_per_s > 0
        assert server.num_served_tokens == 2 * BS
        # Read where they lie: serving a peer moved none of this cache's blocks.
        assert {i.block_hash: i.tier for i in cache.block_infos()} == before
        assert await fetcher.fetch(address, [7] * (2 * BS), 0) == (0, None)
        # The server answers while the loop that started it is held (as a forward holds a
        # prefill worker's loop): a fetch from another thread completes meanwhile.
        done = []

        async def fetch_once() -> None:
            other_fetcher = PrefixFetcher(tcfg, _cfg(), timeout_s=10)
            done.append((await other_fetcher.fetch(address, tokens, 0))[0])
            await other_fetcher.close()

        other = threading.Thread(target=asyncio.run, args=(fetch_once(),))
        other.start()
        other.join(timeout=20)  # blocks this loop
        assert done == [len(tokens)]
        # A peer that answers with an error (a start past the tokens) costs only that fetch.
        frame = FetchPrefix((1,), [1], 2).to_frame()
        reply = await server._answer(frame)
        assert reply.kind == Kind.ERROR and reply.header["code"] == "bad_request"
    finally:
        await server.stop()
    assert await fetcher.fetch(address, tokens, 0) == (0, None)
    assert fetcher.num_failed == 1
    await fetcher.close()


async def test_kv_of_the_wrong_shape_is_refused():
    cache = PrefixCache(PrefixCacheConfig(block_size=BS, device_bytes=1 << 20))
    tokens = list(range(2 * BS))
    cache.insert(tokens, torch.randn(L, 2, len(tokens), H + 1, D))  # another model's KV
    tcfg = transports.TransportConfig()
    listener = await transports.listen("tcp://127.0.0.1:0", PrefixServer(cache).serve, tcfg)
    fetcher = PrefixFetcher(tcfg, _cfg(), timeout_s=10)
    try:
        assert await fetcher.fetch(listener.address, tokens, 0) == (0, None)
        assert fetcher.num_failed == 1 and fetcher.num_fetched_tokens == 0
    finally:
        await fetcher.close()
        await listener.close()
    await asyncio.sleep(0)
