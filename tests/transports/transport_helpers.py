"""Helpers of the transport conformance suite (imported by conftest and the tests)."""

from __future__ import annotations

import asyncio
import os
import uuid

# rdma, fhbn and cuda_ipc run where their devices exist (skipped with the reason elsewhere).
CONFORMANCE_SCHEMES = ["tcp", "shm", "ucx", "rdma", "fhbn", "cuda_ipc"]


def address_for(scheme: str) -> str:
    if scheme in ("shm", "cuda_ipc"):
        return f"{scheme}://test-{uuid.uuid4().hex[:12]}"
    if scheme in ("rdma", "fhbn"):
        from pyverbs.device import get_device_list
        return f"{scheme}://{get_device_list()[0].name.decode()}/1/127.0.0.1:0"
    return f"{scheme}://127.0.0.1:0"


def byte_stream(conn):
    """The connection that carries `conn`'s bytes (cuda_ipc's runs over an shm one), for
    the tests that write bytes that are no frame."""
    return getattr(conn, "_inner", conn)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def transport_tasks() -> list[asyncio.Task]:
    """Pending tasks created by the transports package (never the test's own)."""
    current = asyncio.current_task()
    out = []
    for t in asyncio.all_tasks():
        if t is current or t.done():
            continue
        code = getattr(t.get_coro(), "cr_code", None)
        if code is not None and "/transports/" in code.co_filename:
            out.append(t)
    return out


async def echo(conn) -> None:
    """A handler that sends back every frame it receives, until the connection ends."""
    while True:
        await conn.send(await conn.recv())
