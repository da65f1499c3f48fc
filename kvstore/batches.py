"""The write loop shared by the metadata store's batching publishers (the scheduler's
request journal, a prefill worker's prefix blocks): changes gather in memory, and one
write per batch applies them, off the path that made them."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


async def write_batches(wake: asyncio.Event, flush: Callable[[], Awaitable[bool]], interval_s: float,
                        retry_s: float) -> None:
    """Forever: wait until `wake` is set, let a batch gather for `interval_s`, then
    `flush()` it. A flush that returns False (the store unreachable; it kept its
    changes) is tried again `retry_s` later, not in a tight loop. (A cancellation that a
    flush's Redis command loses is raised again by the store's client: lamina/aio.py.)"""
    while True:
        await wake.wait()
        await asyncio.sleep(interval_s)
        wake.clear()
        flushed = await flush()
        if not flushed:
            await asyncio.sleep(retry_s)
            wake.set()
