"""Routing prompts over several prefill workers: the pure policy (lamina.services.scheduler.prefill_routing)
on hand-checked cases, and the scheduler's side (lamina.services.scheduler.prefill_clients) against a real
Redis holding blocks that real prefix caches published."""

from __future__ import annotations

import asyncio
import re
import uuid

import grpc
import pytest
import torch

from lamina.kvstore.block_publisher import BlockPublisher
from lamina.kvstore.metadata import MetadataConfig, MetadataStore
from lamina.kvstore.prefix_cache import PrefixCache, PrefixCacheConfig
from lamina.kvstore.redis_server import EmbeddedRedis
from lamina.services.config import PREFILL_ROUTINGS, PrefillSection, StackConfig
from lamina.services.protos import lamina_pb2
from lamina.services.scheduler.prefill_clients import PrefillClients
from lamina.services.scheduler.prefill_routing import (
    ROUTINGS,
    PrefillLoad,
    choose,
    choose_by_prefix,
    choose_round_robin,
    matched_tokens,
)

BS = 4  # block size of these tests (tokens)


def loads(*queued: int, alive: tuple[bool, ...] | None = None, last: tuple[int, ...] | None = None):
    n = len(queued)
    alive = alive or (True,) * n
    last = last or (-1,) * n
    return [PrefillLoad(f"prefill-{i}", alive[i], queued[i], last[i]) for i in range(n)]


# -- the policy --------------------------------------------------------------------------------
def test_routings_are_the_configs():
    assert ROUTINGS == PREFILL_ROUTINGS


def test_matched_tokens_count_only_an_unbroken_run_from_the_first_block():
    holders = [{"a", "b"}, {"a", "b"}, {"a"}, {"a", "b"}, set(), {"a"}]
    # a: blocks 0-3 (block 4 nobody has); b: blocks 0-1 (it lacks block 2, so its block 3 is of no use).
    assert matched_tokens(holders, BS) == {"a": 16, "b": 8}
    assert matched_tokens([{"b"}, {"a", "b"}], BS) == {"b": 8}  # a lacks the first block
    assert matched_tokens([], BS) == {}


def test_the_longest_prefix_wins():
    assert choose_by_prefix(loads(0, 0, 0), {"prefill-1": 32, "prefill-2": 48}, 1.0) == 2
    assert choose_by_prefix(loads(0, 0), {"prefill-0": 16, "prefill-1": 8}, 1.0) == 0


def test_a_much_busier_worker_loses_to_an_idle_one():
    # prefill-0 holds 64 tokens but has 1,000 queued: 64 - 1000 < 0 - 0.
    assert choose_by_prefix(loads(1000, 0), {"prefill-0": 64}, 1.0) == 1
    # A little queue does not outweigh a long prefix: 64 - 20 > 0.
    assert choose_by_prefix(loads(20, 0), {"prefill-0": 64}, 1.0) == 0
    # The weight scales the queue: 64 - 4 x 20 < 0.
    assert choose_by_prefix(loads(20, 0), {"prefill-0": 64}, 4.0) == 1
    # Weight 0: load does not count at all.
    assert choose_by_prefix(loads(10**6, 0), {"prefill-0": 16}, 0.0) == 0


def test_ties_go_to_the_least_loaded_then_the_least_recently_chosen():
    # Equal scores (16 - 16 = 0 - 0) with weight 1: the one with less queued wins.
    assert choose_by_prefix(loads(16, 0), {"prefill-0": 32, "prefill-1": 16}, 1.0) == 1
    # Weight 0 and equal prefixes: the least loaded.
    assert choose_by_prefix(loads(30, 10, 20), {}, 0.0) == 1
    # Same prefix and load: the one chosen least recently, then the lowest index.
    assert choose_by_prefix(loads(0, 0, 0, last=(5, 3, 7)), {}, 1.0) == 1
    assert choose_by_prefix(loads(0, 0), {}, 1.0) == 0


def test_a_prefix_every_worker_holds_or_a_small_gain_is_no_home():
    # Both hold the shared first 16 tokens; prefill-1 holds 8 more, under the least gain of
    # 16: no home, so the least loaded (prefill-0) takes it, whatever the weight.
    for weight in (0.0, 1.0):
        assert choose_by_prefix(loads(0, 4), {"prefill-0": 16, "prefill-1": 24}, weight, 16) == 0
    # 16 more: a home, followed against a little load.
    assert choose_by_prefix(loads(0, 4), {"prefill-0": 16, "prefill-1": 32}, 1.0, 16) == 1
    # Only prefill-0 holds the one shared block (prefill-1 is new): with weight 0 and no least
    # gain it would take every new conversation; with a least gain of 2 blocks they are dealt out.
    assert choose_by_prefix(loads(0, 0, last=(2, 1)), {"prefill-0": 16}, 0.0, 0) == 0
    assert choose_by_prefix(loads(0, 0, last=(2, 1)), {"prefill-0": 16}, 0.0, 32) == 1
    # The gain counts from what every live worker holds: a dead worker's lack of it does not.
    assert choose_by_prefix(loads(0, 0, 0, alive=(True, True, False), last=(2, 1, 0)),
                            {"prefill-0": 64, "prefill-1": 64}, 0.0, 32) == 1


def test_a_prompt_with_no_home_goes_to_the_worker_sent_the_least_work_lately():
    ws = [PrefillLoad("prefill-0", recent_tokens=900.0, last_chosen=1),
          PrefillLoad("prefill-1", recent_tokens=300.0, queued_tokens=50, last_chosen=2)]
    assert choose_by_prefix(ws, {}, 0.0, 32) == 1  # less recent work, though queued and chosen last
    assert choose_by_prefix(ws, {"prefill-0": 16}, 0.0, 32) == 1  # one block held: still no home
    assert choose_by_prefix(ws, {"prefill-0": 64}, 0.0, 32) == 0  # a home outweighs the balance


def test_recent_work_halves_every_half_life():
    from lamina.services.scheduler.prefill_clients import _RECENT_HALF_LIFE_S, _Worker

    w = _Worker("prefill-0")
    w.add_recent(1000, now=10.0)
    assert w.recent(10.0) == 1000
    assert w.recent(10.0 + _RECENT_HALF_LIFE_S) == pytest.approx(500)
    w.add_recent(100, now=10.0 + 2 * _RECENT_HALF_LIFE_S)
    assert w.recent(10.0 + 2 * _RECENT_HALF_LIFE_S) == pytest.approx(350)


def test_a_worker_queued_far_past_the_least_is_not_waited_for():
    # prefill-0 holds 1,024 tokens of the prompt; with weight 0 only the gap keeps it from a long queue.
    held = {"prefill-0": 1024}
    assert choose_by_prefix(loads(4000, 0), held, 0.0, 32, 4096) == 0  # 4,000 <= 4,096 more: wait for it
    assert choose_by_prefix(loads(5000, 0), held, 0.0, 32, 4096) == 1  # too busy
    assert choose_by_prefix(loads(5000, 0), held, 0.0, 32, None) == 0  # no gap: never too busy
    # The gap counts from the least queued live worker; a dead one's empty queue does not count.
    assert choose_by_prefix(loads(5000, 2000, 0, alive=(True, True, False)), held, 0.0, 32, 4096) == 0
    # Among the workers near the least, the longest prefix; the others' prefixes do not count.
    assert choose_by_prefix(loads(9000, 100, 0), {"prefill-0": 4096, "prefill-1": 64}, 0.0, 32, 4096) == 1


def test_a_dead_or_unregistered_worker_is_never_chosen():
    # prefill-0 holds the whole prefix but is down; prefill-7 (not a worker of this stack) too.
    assert choose_by_prefix(loads(0, 500, alive=(False, True)), {"prefill-0": 4096, "prefill-7": 4096}, 1.0) == 1
    assert choose_by_prefix(loads(0, alive=(False,)), {"prefill-0": 64}, 1.0) is None
    assert choose_round_robin(loads(0, 0, alive=(False, False))) is None
    assert choose("prefix", [], {}, 1.0) is None


def test_round_robin_takes_each_live_worker_in_turn():
    assert choose_round_robin(loads(0, 0, 0, last=(3, 1, 2))) == 1
    assert choose_round_robin(loads(0, 0, 0, last=(3, 1, 2), alive=(True, False, True))) == 2
    assert choose("round_robin", loads(0, 0, last=(1, -1)), {"prefill-0": 64}, 1.0) == 1
    with pytest.raises(ValueError, match="unknown prefill routing"):
        choose("random", loads(0), {}, 1.0)


# -- the scheduler's side, over a real Redis -------------------------------------------------
@pytest.fixture(scope="module")
def redis_url():
    with EmbeddedRedis() as server:
        yield server.url


class _Stub:
    """A PrefillStub whose Prefill answers after `release` is set, or fails with `code`."""

    def __init__(self, code: grpc.StatusCode | None = None) -> None:
        self.code = code
        self.release = asyncio.Event()
        self.calls = 0

    async def Prefill(self, request, timeout):  # noqa: N802, ASYNC109 (the gRPC stub's signature)
        self.calls += 1
        await self.release.wait()
        if self.code is not None:
            raise grpc.aio.AioRpcError(self.code, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone")
        return "result"


def _clients(store: MetadataStore, routing: str = "prefix", peer_fetch: str = "auto") -> PrefillClients:
    config = StackConfig(prefill=PrefillSection(workers=2, cache_block_tokens=BS, routing=routing,
                                                peer_fetch=peer_fetch, routing_min_gain_tokens=2 * BS,
                                                routing_max_queue_gap_tokens=512))
    clients = PrefillClients(config, store, open_channel=lambda address: None)
    for i, w in enumerate(clients.workers):
        w.stub, w.alive, w.endpoint, w.data_address = _Stub(), True, "unused", f"tcp://127.0.0.1:{7000 + i}"
    clients._refreshed_at = float("inf")  # no refresh: nothing is registered in this store
    return clients


async def _publish(store: MetadataStore, node: str, prompts: list[list[int]]) -> None:
    """What a prefill worker does: cache the prompts and publish the cache's blocks."""
    publisher = BlockPublisher(store, node, interval_s=0.0)
    cache = PrefixCache(PrefixCacheConfig(block_size=BS, device_bytes=1 << 20), on_event=publisher.on_event)
    publisher.cache = cache
    for p in prompts:
        cache.insert(p, torch.zeros(2, 2, len(p), 1, 2))
    publisher.start()
    await publisher.flush()
    await publisher.close()


async def test_prompts_go_to_the_worker_whose_cache_holds_their_prefix(redis_url):
    store = MetadataStore(MetadataConfig(redis_url, f"t{uuid.uuid4().hex[:10]}"))
    try:
        shared = list(range(100, 100 + 3 * BS))
        await _publish(store, "prefill-1", [shared + [7] * BS])
        await _publish(store, "prefill-0", [shared[:BS] + [9] * BS])
        clients = _clients(store)
        # prefill-1 holds 3 blocks of it (the last prompt token is always computed), prefill-0 one:
        # a gain of 2 blocks, the least these clients follow.
        assert await clients.route(shared + [1, 2]) == (1, 3 * BS, None)
        # Nothing cached anywhere: the worker chosen least recently (prefill-0).
        assert await clients.route([5] * (3 * BS)) == (0, 0, None)
        # A prompt of exactly the cached blocks: the last token is recomputed, so 2 blocks match.
        assert await clients.route(shared) == (1, 2 * BS, None)

        # prefill-1 busy with 1,000 queued tokens, over the gap of 512: the idle prefill-0 gets the next one.
        busy = clients.workers[1].stub
        call = asyncio.create_task(clients.prefill(1, _request(1000 + 3 * BS), 3 * BS))
        await asyncio.sleep(0)
        assert clients.workers[1].queued_tokens == 1000
        assert await clients.route(shared + [1, 2]) == (0, BS, None)
        busy.release.set()
        assert await call == "result" and clients.workers[1].queued_tokens == 0

        # A worker whose call fails as a lost one does is routed around, its queue emptied.
        clients.workers[1].stub = _Stub(grpc.StatusCode.UNAVAILABLE)
        clients.workers[1].stub.release.set()
        with pytest.raises(grpc.aio.AioRpcError):
            await clients.prefill(1, _request(20), 0)
        assert not clients.workers[1].alive and clients.workers[1].queued_tokens == 0
        # prefill-0 is expected to hold 3 blocks now: the store shows one, and the prompt routed
        # to it above claimed the rest (lamina.services.scheduler.prefix_claims).
        assert await clients.route(shared + [1, 2]) == (0, 3 * BS, None)
        clients.workers[0].alive = False
        assert await clients.route(shared + [1, 2]) is None

        # Round robin ignores the store.
        rr = _clients(store, "round_robin")
        assert [(await rr.route(shared + [1, 2]))[0] for _ in range(3)] == [0, 1, 0]
    finally:
        await store.close()


def _request(num_tokens: int):
    from lamina.services.protos import lamina_pb2

    return lamina_pb2.PrefillRequest(seq_id="r", token_ids=[1] * num_tokens)


def test_prefill_workers_configuration(tmp_path):
    from lamina.services.config import ConfigError, load_config

    cfg = load_config(env={"LAMINA_PREFILL_WORKERS": "3", "LAMINA_PREFILL_ROUTING": "round_robin"},
                      overrides={"prefill.cache_disk_bytes": 1 << 20, "prefill.cache_dir": str(tmp_path)})
    assert (cfg.prefill.workers, cfg.prefill.routing, cfg.data_plane_processes) == (3, "round_robin", 6)
    assert cfg.prefill.worker_cache_dir(2) == str(tmp_path / "prefill-2")  # disk tiers apart
    one = load_config(env={}, overrides={"prefill.cache_dir": str(tmp_path)})
    assert one.prefill.worker_cache_dir(0) == str(tmp_path)  # one worker keeps the directory as it was
    for env, message in (({"LAMINA_PREFILL_WORKERS": "0"}, "prefill.workers must be a positive integer"),
                         ({"LAMINA_PREFILL_ROUTING": "random"}, "prefill.routing must be one of prefix, round_robin")):
        with pytest.raises(ConfigError, match=message):
            load_config(env=env)
    with pytest.raises(ConfigError, match=r"prefill\.routing_load_weight must be a non-negative number"):
        load_config(env={}, overrides={"prefill.routing_load_weight": -1})
    for name in ("prefill.routing_min_gain_tokens", "prefill.routing_max_queue_gap_tokens"):
        with pytest.raises(ConfigError, match=re.escape(f"{name} must be a non-negative integer")):
            load_config(env={}, overrides={name: -1})


def test_prefill_device_configuration(capsys):
    from lamina.services.config import ConfigError, load_config
    from lamina.services.prefill.prefill_service import PrefillService, cache_config

    assert load_config(env={}).prefill.device == "cpu"
    for name in ("cuda", "cuda:1"):
        cfg = load_config(env={"LAMINA_PREFILL_DEVICE": name})
        assert cfg.prefill.device == name and cache_config(cfg.prefill, 0).device == name  # the device tier there
    for bad in ("gpu", "cuda:", "cuda:x", "cpu:0"):
        with pytest.raises(ConfigError, match=r"prefill\.device must be cpu, cuda or cuda:N"):
            load_config(env={"LAMINA_PREFILL_DEVICE": bad})
    from lamina.cli import main

    assert main(["up", "--prefill-device", "gpu"]) == 2  # refused before anything starts
    assert "prefill.device must be cpu, cuda or cuda:N" in capsys.readouterr().err
    assert main(["up", "--attention-workers", "2", "--attention-max-workers", "1"]) == 2  # the pool's flag too
    assert "attention.max_workers must be 0 (a fixed pool) or at least attention.workers" in capsys.readouterr().err
    if not torch.cuda.is_available():  # a worker asked for a GPU it has not got says so before loading anything
        with pytest.raises(ConfigError, match=r"prefill\.device is cuda, but torch finds no CUDA device here"):
            PrefillService(load_config(env={"LAMINA_PREFILL_DEVICE": "cuda"}))


async def test_a_prompt_routed_away_from_its_prefix_fetches_it_when_that_is_faster(redis_url):
    """Round robin sends the prompt to prefill-0, which holds one block of it; prefill-1
    holds three. By prefill-0's published figures the fetch is planned exactly when the
    transfer beats computing the two blocks between."""
    store = MetadataStore(MetadataConfig(redis_url, f"t{uuid.uuid4().hex[:10]}"))
    try:
        shared = list(range(100, 100 + 3 * BS))
        await _publish(store, "prefill-1", [shared + [7] * BS])
        await _publish(store, "prefill-0", [shared[:BS] + [9] * BS])
        prompt = shared + [1, 2]
        clients = _clients(store, "round_robin")
        # No figures yet (no forward has run): auto computes.
        assert await clients.route(prompt) == (0, BS, None)
        # 1,000 tokens/s and 1 MB per token at 1 GB/s: 1 ms per token either way, plus the
        # fetch's fixed cost: computing wins; at 10 GB/s fetching wins.
        for bandwidth, fetches in ((1e9, False), (1e10, True)):
            clients.workers[0].figures = {"compute_tokens_per_s": 1000.0, "fetch_bytes_per_s": bandwidth,
                                          "kv_bytes_per_token": 1_000_000}
            clients.workers[0].last_chosen = clients.workers[1].last_chosen = -1
            worker, expected, plan = await clients.route(prompt)
            assert worker == 0
            if fetches:
                assert (plan.peer, plan.tokens, expected) == ("prefill-1", 3 * BS, 3 * BS)
                assert clients.peer_prefix(plan) == lamina_pb2.PeerPrefix(
                    node="prefill-1", address=clients.workers[1].data_address, tokens=3 * BS)
            else:
                assert (plan, expected) == (None, BS)
        # A peer that is down is never asked.
        clients.workers[1].alive = False
        clients.workers[0].last_chosen = -1
        assert (await clients.route(prompt))[2] is None
        # always: whatever the figures; off: never.
        always, off = _clients(store, "round_robin", "always"), _clients(store, "round_robin", "off")
        assert (await always.route(prompt))[2].tokens == 3 * BS
        assert (await off.route(prompt))[2] is None
    finally:
        await store.close()


def test_prefix_cache_tiers_and_quantization_from_the_configuration(tmp_path):
    """The stack's configuration turns on the host and disk tiers and their 4-bit blocks;
    the prefill worker's cache is built from it, and a block moved to host is 4-bit."""
    from lamina.kvstore.quant import QuantizedTensor
    from lamina.kvstore.tiers import Tier
    from lamina.services.config import ConfigError, load_config
    from lamina.services.prefill.prefill_service import cache_config

    cfg = load_config(env={"LAMINA_PEER_FETCH": "off"}, overrides={
        "prefill.cache_quantize_4bit": True, "prefill.cache_quant_group_size": 32, "prefill.cache_disk_bytes": 1 << 20,
        "prefill.cache_dir": str(tmp_path), "prefill.cache_device_bytes": 2 * 2 * BS * 2 * 4,
        "prefill.cache_block_tokens": BS})
    assert cfg.prefill.peer_fetch == "off"
    cc = cache_config(cfg.prefill, 0)
    assert (cc.quantize_4bit, cc.quant_group_size, cc.disk_bytes, cc.disk_dir) == (True, 32, 1 << 20, str(tmp_path))
    cache = PrefixCache(cc)
    cache.insert(list(range(2 * BS)), torch.randn(2, 2, 2 * BS, 1, 2))  # 2 blocks: one fits on device
    (host,) = [i for i in cache.block_infos() if i.tier == Tier.HOST]
    assert isinstance(cache._tiers[Tier.HOST].get(host.block_hash), QuantizedTensor)
    for overrides, message in (({"prefill.cache_quant_group_size": 3}, "must be a positive even integer"),
                               ({"prefill.peer_fetch": "maybe"}, "must be one of auto, always, off"),
                               ({"prefill.peer_fetch_prior_gbps": 0}, "must be a positive number")):
        with pytest.raises(ConfigError, match=message):
            load_config(env={}, overrides=overrides)


# -- claims: blocks routed and not yet in the store ---------------------------------------------
def test_claims_add_to_the_store_until_they_expire_or_settle():
    from lamina.services.scheduler.prefix_claims import PrefixClaims

    claims = PrefixClaims()
    claims.claim("prefill-1", ["h0", "h1"], until=30.0)
    store = [{"prefill-0"}, set(), set()]
    assert claims.add_to(store, ["h0", "h1", "h2"], ["prefill-0", "prefill-1"], now=1.0) == \
        [{"prefill-0", "prefill-1"}, {"prefill-1"}, set()]
    assert store == [{"prefill-0"}, set(), set()]  # the store's answer is left as it was
    # Answered at 2.0: the claims end a moment later; a later claim of the same block extends it.
    claims.settle("prefill-1", ["h0", "h1"], until=3.0)
    claims.claim("prefill-1", ["h1"], until=40.0)
    assert claims.add_to([set(), set()], ["h0", "h1"], ["prefill-1"], now=3.5) == [set(), {"prefill-1"}]
    claims.prune(now=3.5)
    assert len(claims) == 1
    claims.prune(now=40.0)
    assert len(claims) == 0


async def test_a_turn_sent_while_the_last_one_computes_follows_it(redis_url):
    store = MetadataStore(MetadataConfig(redis_url, f"t{uuid.uuid4().hex[:10]}"))
    try:
        clients = _clients(store)
        history = list(range(100, 100 + 6 * BS))
        # Turn 1: nothing cached anywhere, so the lowest index; it is still computing (not answered).
        i, cached, _ = await clients.route(history + [1])
        assert (i, cached) == (0, 0)
        call = asyncio.create_task(clients.prefill(0, _request_of(history + [1]), 0))
        await asyncio.sleep(0)
        # Turn 2 extends turn 1: the store shows nothing yet, but the claim sends it after turn 1,
        # although prefill-0 has the longer queue.
        assert (await clients.route(history + [1] + [2] * BS))[0] == 0
        # A prompt sharing nothing goes to the idle worker.
        assert (await clients.route([9] * (4 * BS)))[0] == 1
        clients.workers[0].stub.release.set()
        assert await call == "result"
        # Round robin claims nothing.
        rr = _clients(store, "round_robin")
        await rr.route(history + [1])
        assert len(rr.claims) == 0
    finally:
        await store.close()


def _request_of(token_ids: list[int]):
    from lamina.services.protos import lamina_pb2

    return lamina_pb2.PrefillRequest(seq_id="r", token_ids=token_ids)


def test_a_prefill_calls_deadline_covers_the_tokens_queued_at_its_worker():
    """rpc_s plus the queued tokens at the worker's published rate slowed SLOWDOWN times,
    or at the configured prior before it published one; the clients read both from the
    worker's figures and the configuration."""
    from lamina.services.config import DeadlinesSection
    from lamina.services.scheduler.prefill_deadline import SLOWDOWN, prefill_deadline_s

    assert prefill_deadline_s(30.0, 0, None, 50.0) == 30.0
    assert prefill_deadline_s(30.0, 8000, None, 50.0) == 30.0 + 160.0
    assert prefill_deadline_s(30.0, 8000, 1600.0, 50.0) == 30.0 + 8000 / (1600.0 / SLOWDOWN)
    config = StackConfig(deadlines=DeadlinesSection(rpc_s=5.0, prefill_tokens_per_s=100.0))
    clients = PrefillClients(config, None, open_channel=lambda address: None)  # type: ignore[arg-type]
    w = clients.workers[0]
    w.queued_tokens = 1000
    assert clients.deadline_s(w) == 5.0 + 10.0
    w.figures = {"compute_tokens_per_s": 4000.0}
    assert clients.deadline_s(w) == 5.0 + 1000 / (4000.0 / SLOWDOWN)
    assert clients.deadline_s(w, 500) == 5.0 + 1500 / (4000.0 / SLOWDOWN)  # a prompt routed, not yet sent
