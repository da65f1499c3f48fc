"""Chunked prefill (`prefill.chunk_tokens`, services/prefill/chunking.py): the policy, and
the prefill worker computing a long prompt in chunks with the real model and a real
attention worker's data-plane handler over TCP, without processes or Redis (no Redis
call is made here).

A short prompt sent while a long one's first chunk computes joins its second forward and
gets its first token before the long one does; computed whole, the long prompt's forward
holds it until the end. Chunks change neither prompt's first token nor the KV the
attention worker holds (float32, to the last bits of a sum's order)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from lamina import transports
from lamina.services.attention.attention_service import AttentionService
from lamina.services.attention_pool import AttentionPool
from lamina.services.config import AttentionSection, ConfigError, PrefillSection, StackConfig, load_config
from lamina.services.prefill.chunking import chunk_tokens, continuing_takes, first_take
from lamina.services.prefill.prefill_service import PrefillService, take_batch
from lamina.services.protos import lamina_pb2

pytestmark = pytest.mark.timeout(300)

LONG = [(7 * i + 3) % 4000 + 100 for i in range(300)]  # 300 tokens: five chunks of 64 (the last 44)
SHORT = [500 + i for i in range(10)]


def test_prompts_in_progress_take_a_chunk_each_and_leave_a_chunk_for_new_ones():
    assert continuing_takes([300, 40], 64, 256) == [64, 40]
    assert continuing_takes([300, 300, 300, 300], 64, 256) == [64, 64, 64, 0]  # a chunk of 256 left for new ones
    assert continuing_takes([300], 512, 256) == [300]  # the first always computes, past the room
    assert continuing_takes([300, 10], 512, 256) == [300, 0]
    assert continuing_takes([], 64, 256) == []
    assert first_take(300, 64, whole=False) == 64 and first_take(30, 64, whole=False) == 30
    assert first_take(300, 64, whole=True) == 300  # a prompt scoring its own tokens: whole
    assert chunk_tokens(0, "cpu") == 512 and chunk_tokens(0, "cuda") == 2048 and chunk_tokens(100, "cuda") == 100


def test_a_queued_prompt_counts_its_first_chunk_toward_a_forward():
    queue = [(lamina_pb2.PrefillRequest(seq_id=s, token_ids=[1] * n), None) for s, n in (("l", 300), ("s", 60))]
    whole = list(queue)
    assert [r.seq_id for r, _ in take_batch(whole, 128)] == ["l"]  # 300 alone
    chunked = list(queue)
    assert [r.seq_id for r, _ in take_batch(chunked, 128, size=lambda r: first_take(len(r.token_ids), 64, False))
            ] == ["l", "s"]  # 64 + 60


def test_a_kv_store_adopts_another_stores_sequence_within_its_capacity():
    from lamina.engine.kv import KVCapacityError, KVStore
    from lamina.model.checkpoints import load_config as load_model_config

    cfg = load_model_config(None)
    first = KVStore(cfg, capacity_bytes=1 << 26)
    seq = first.reserve("s", 100)
    seq.length = 64  # a chunk's KV
    second = KVStore(cfg, capacity_bytes=seq.nbytes() + 1)
    second.adopt("s", seq)
    assert second.get("s") is seq and second.used_bytes == seq.nbytes() and second.num_tokens == 64
    with pytest.raises(ValueError, match="already held"):
        second.adopt("s", seq)
    with pytest.raises(KVCapacityError):
        second.adopt("t", first.reserve("t", 10))


def test_chunk_tokens_from_the_environment_and_checked():
    assert load_config(env={}).prefill.chunk_tokens == 0
    assert load_config(env={"LAMINA_PREFILL_CHUNK_TOKENS": "256"}).prefill.chunk_tokens == 256
    with pytest.raises(ConfigError, match=r"prefill\.chunk_tokens must be a non-negative integer"):
        load_config(env={}, overrides={"prefill.chunk_tokens": -1})


def _request(seq_id: str, token_ids: list[int]) -> lamina_pb2.PrefillRequest:
    return lamina_pb2.PrefillRequest(seq_id=seq_id, token_ids=token_ids, params=lamina_pb2.SamplingParams(max_tokens=1),
                                     placement=lamina_pb2.Placement(workers=[0]))


class _Worker:
    """A prefill service and one attention worker's handler over TCP; each forward's
    prompts and tokens recorded, `started` set as each forward begins."""

    def __init__(self, chunk: int) -> None:
        self.config = StackConfig(redis_url="redis://127.0.0.1:1",
                                  prefill=PrefillSection(chunk_tokens=chunk, max_batch_tokens=128),
                                  attention=AttentionSection(workers=1, kv_capacity_bytes=64 << 20))
        self.svc = PrefillService(self.config)
        self.attention = AttentionService(self.config)
        self.forwards: list[list[tuple[str, int]]] = []
        self.started = asyncio.Event()
        forward = self.svc._forward

        async def recorded(kv, prompts):
            self.forwards.append([(p.seq_id, p.take) for p in prompts])
            self.started.set()
            return await forward(kv, prompts)

        self.svc._forward = recorded  # type: ignore[method-assign]

    async def __aenter__(self) -> _Worker:
        self.listener = await transports.listen("tcp://127.0.0.1:0", self.attention._serve_connection,
                                                self.config.transport_config())
        self.svc.pool = await AttentionPool.connect([self.listener.address], "request", self.svc.cfg,
                                                    self.config.transport_config())
        self.loop = asyncio.create_task(self.svc._batch_loop())
        return self

    async def __aexit__(self, *exc) -> None:
        self.loop.cancel()
        await asyncio.gather(self.loop, return_exceptions=True)
        assert self.svc.pool is not None
        await self.svc.pool.close()
        await self.listener.close()
        self.svc.forward_thread.close(wait=True)

    async def next_forward(self) -> None:
        self.started.clear()
        await asyncio.wait_for(self.started.wait(), 60)

    def counter(self, name: str) -> float:
        return self.svc.runtime.registry.get_sample_value(name) or 0.0

    def stored_kv(self, seq_id: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        slabs = self.attention.core.slabs
        return [tuple(t.clone() for t in slabs.read(seq_id, i)) for i in range(self.svc.cfg.num_layers)]


async def _long_then_short(chunk: int) -> dict:
    """The long prompt, and the short one once the long one's first forward has begun."""
    async with _Worker(chunk) as w:
        order: list[str] = []

        async def prefill(seq_id: str, tokens: list[int]) -> lamina_pb2.PrefillResult:
            result = await w.svc.prefill(_request(seq_id, tokens))
            order.append(seq_id)
            return result

        long = asyncio.create_task(prefill("long", LONG))
        await w.next_forward()
        long_result, short_result = await asyncio.gather(long, prefill("short", SHORT))
        return {"forwards": w.forwards, "order": order, "tokens": (long_result.token_id, short_result.token_id),
                "kv": w.stored_kv("long"), "chunks": w.counter("lamina_prefill_chunks_total"),
                "computed": w.counter("lamina_prefill_tokens_total")}


async def test_a_short_prompt_joins_the_next_chunk_of_a_long_one_and_nothing_else_changes():
    chunked = await _long_then_short(64)
    whole = await _long_then_short(10_000)
    # Chunked: the short prompt's forward is the long one's second; it is answered first.
    assert chunked["forwards"] == [[("long", 64)], [("long", 64), ("short", 10)], [("long", 64)], [("long", 64)],
                                   [("long", 44)]]
    assert chunked["order"] == ["short", "long"] and chunked["chunks"] == 4
    # Whole: the short prompt waits for the long one's whole forward.
    assert whole["forwards"] == [[("long", 300)], [("short", 10)]]
    assert whole["order"] == ["long", "short"] and whole["chunks"] == 0
    assert chunked["tokens"] == whole["tokens"] and chunked["computed"] == whole["computed"] == 310
    for (k1, v1), (k2, v2) in zip(chunked["kv"], whole["kv"], strict=True):
        assert k1.shape[0] == len(LONG)
        torch.testing.assert_close(k1, k2, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v1, v2, atol=1e-4, rtol=1e-4)


async def test_a_prompt_whose_caller_went_away_between_chunks_is_dropped():
    async with _Worker(64) as w:
        long = asyncio.create_task(w.svc.prefill(_request("long", LONG)))
        await w.next_forward()
        await w.next_forward()  # its second chunk
        long.cancel()
        result = await asyncio.wait_for(w.svc.prefill(_request("short", SHORT)), 60)
        assert result.token_id >= 0
        # Its second chunk ended; then it was dropped, its KV never sent.
        assert w.forwards == [[("long", 64)], [("long", 64)], [("short", 10)]]
        assert w.counter("lamina_prefill_abandoned_total") == 1 and w.svc._continuing == []
        assert not w.attention.core.slabs.has_request("long") and w.attention.core.slabs.has_request("short")
