"""Pieces of failure recovery that need no stack: the attention pool's reply deadline
and reconnection (over real TCP connections), the rebuild's token list, the deadlines
configuration."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from lamina import transports
from lamina.model.checkpoints import load_config
from lamina.services.attention_pool import AttentionPool, SeqRows
from lamina.services.config import ConfigError
from lamina.services.config import load_config as load_stack_config
from lamina.services.protos import lamina_pb2
from lamina.services.scheduler.scheduler_state import Request
from lamina.services.wire import decode_tag, frame_tag, result_frame

pytestmark = pytest.mark.timeout(60)


async def _silent(conn: transports.Connection) -> None:
    """A worker that reads frames and never answers (a stopped or hung process)."""
    try:
        while True:
            await conn.recv()
    except transports.TransportError:
        return


async def _answering(conn: transports.Connection) -> None:
    """A worker that answers every frame with a zero result of Q's shape."""
    try:
        while True:
            frame = await conn.recv()
            await conn.send(result_frame(frame_tag(frame), torch.zeros_like(frame.tensors[0])))
    except transports.TransportError:
        return


async def _closing(conn: transports.Connection) -> None:
    """A worker that dies on the first frame."""
    await conn.recv()
    await conn.close()


def _qkv(cfg):
    return (torch.randn(1, cfg.num_heads, cfg.head_dim), torch.randn(1, cfg.num_kv_heads, cfg.head_dim),
            torch.randn(1, cfg.num_kv_heads, cfg.head_dim))


@pytest.mark.parametrize("first", [_silent, _closing], ids=["silent", "closing"])
async def test_a_lost_worker_fails_the_step_in_time_and_is_reconnected_on_next_use(first):
    cfg = load_config(None)
    lost = await transports.listen("tcp://127.0.0.1:0", first)
    back = await transports.listen("tcp://127.0.0.1:0", _answering)
    pool = await AttentionPool.connect([lost.address], "request", cfg, transports.TransportConfig(),
                                       reply_timeout_s=0.5, reconnect=lambda w: transports.connect(back.address))
    try:
        route = pool.route([SeqRows("s", 1, (0,))])
        start = time.monotonic()
        with pytest.raises(transports.TransportError):
            await pool.attend(decode_tag(0, 1, 0), 0, route, *_qkv(cfg))
        assert time.monotonic() - start < 3.0  # the deadline, not a hang
        assert pool.reconnects == 0
        out = await pool.attend(decode_tag(0, 2, 0), 0, route, *_qkv(cfg))
        assert out.shape == (1, cfg.num_heads, cfg.head_dim)
        assert pool.reconnects == 1
    finally:
        await pool.close()
        await lost.close()
        await back.close()


async def test_without_a_reconnect_rule_a_lost_link_stays_an_error():
    cfg = load_config(None)
    lost = await transports.listen("tcp://127.0.0.1:0", _closing)
    pool = await AttentionPool.connect([lost.address], "request", cfg, transports.TransportConfig(),
                                       reply_timeout_s=5.0)
    try:
        route = pool.route([SeqRows("s", 1, (0,))])
        with pytest.raises(transports.TransportError):
            await pool.attend(decode_tag(0, 1, 0), 0, route, *_qkv(cfg))
        await asyncio.sleep(0.05)
        with pytest.raises(transports.TransportError, match="closed"):
            await pool.attend(decode_tag(0, 2, 0), 0, route, *_qkv(cfg))
    finally:
        await pool.close()
        await lost.close()


async def test_a_worker_the_registry_no_longer_names_is_reached_at_its_last_endpoint():
    """A pool from a real registry (Redis): a worker whose link failed and whose
    registration is gone (as one lapses while Redis is cut off from it) is connected
    again at the endpoint it was last reached at, and serves; once nothing answers there
    either, the step fails saying both."""
    import uuid

    from lamina.kvstore.metadata import MetadataConfig, MetadataStore
    from lamina.kvstore.redis_server import EmbeddedRedis

    cfg = load_config(None)
    opened = 0

    async def first_closes(conn: transports.Connection) -> None:
        nonlocal opened
        opened += 1
        await (_closing if opened == 1 else _answering)(conn)

    with EmbeddedRedis() as server:
        async with MetadataStore(MetadataConfig(url=server.url, namespace=f"t{uuid.uuid4().hex[:8]}")) as store:
            worker = await transports.listen("tcp://127.0.0.1:0", first_closes)
            await store.register_service("attention", "attention-0", worker.address)
            config = load_stack_config(env={}, overrides={"attention.workers": 1})
            pool = await AttentionPool.from_registry(store, config, cfg)
            try:
                route = pool.route([SeqRows("s", 1, (0,))])
                with pytest.raises(transports.TransportError):
                    await pool.attend(decode_tag(0, 1, 0), 0, route, *_qkv(cfg))  # the first link closes
                await store.deregister_service("attention", "attention-0")
                out = await pool.attend(decode_tag(0, 2, 0), 0, route, *_qkv(cfg))
                assert out.shape == (1, cfg.num_heads, cfg.head_dim) and pool.reconnects == 1 and opened == 2
                await worker.close()  # the worker gone: its link ends, and its endpoint refuses
                with pytest.raises(transports.TransportError):
                    await pool.attend(decode_tag(0, 3, 0), 0, route, *_qkv(cfg))
                with pytest.raises(transports.TransportError,
                                   match=r"not registered \(down or restarting\), and its last endpoint tcp://"):
                    await pool.attend(decode_tag(0, 4, 0), 0, route, *_qkv(cfg))
            finally:
                await pool.close()
                await worker.close()


def test_a_request_lost_again_waits_longer_before_its_rebuild():
    from lamina.services.scheduler.scheduler_recovery import MAX_RECOVERIES, pause_before

    pauses = [pause_before(n) for n in range(1, MAX_RECOVERIES + 1)]
    assert pauses == [0.0, 0.25, 0.5]  # the first at once; under a second in all
    assert pause_before(10) == 2.0


def test_a_rebuild_recomputes_every_token_but_the_newest_output():
    req = Request("r", [1, 2, 3], lamina_pb2.SamplingParams(max_tokens=8), asyncio.Queue())
    req.output_ids = [7, 8, 9]
    assert req.rebuild_ids == [1, 2, 3, 7, 8]  # 9 is the next step's input
    assert req.kv_id == "r"
    req.recoveries = 2
    assert req.kv_id == "r#2"  # a rebuilt KV never shares an id with the one it replaces


def test_deadlines_are_configured_and_checked():
    cfg = load_stack_config(overrides={"deadlines.reply_s": "2.5"}, env={})
    assert cfg.deadlines.reply_s == 2.5 and cfg.deadlines.recovery_s == 120.0
    with pytest.raises(ConfigError, match=r"deadlines\.health_s must be a positive number"):
        load_stack_config(overrides={"deadlines.health_s": 0}, env={})
