"""A prefill worker's own batch loop in the test's process, sending to an attention
worker's data-plane handler over TCP (no Redis call is made)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from lamina import transports
from lamina.services.attention.attention_service import AttentionService
from lamina.services.attention_pool import AttentionPool
from lamina.services.prefill.prefill_service import PrefillService


@contextlib.asynccontextmanager
async def serving_prefill(svc: PrefillService, attention: AttentionService) -> AsyncIterator[None]:
    """`svc`'s batch loop running, its pool connected to `attention` over TCP; the loop,
    the connection, the listener and the forward thread stopped on the way out."""
    tcfg = svc.config.transport_config()
    listener = await transports.listen("tcp://127.0.0.1:0", attention._serve_connection, tcfg)
    svc.pool = await AttentionPool.connect([listener.address], "request", svc.cfg, tcfg)
    loop = asyncio.create_task(svc._batch_loop())
    try:
        yield
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await svc.pool.close()
        await listener.close()
        svc.forward_thread.close(wait=True)
