"""A real peer process for the kill tests: ``sender ADDRESS`` connects and streams large
frames until killed; ``server ADDRESS`` listens, prints its address, receives one frame
and then never answers; ``echo ADDRESS [RING_BYTES]`` listens, prints its address and
sends every frame back (its tensors as it received them: cuda_ipc's on its GPU, in rings
of RING_BYTES where given, device-ordered where ORDER is ``device``), after
``header["sleep"]`` seconds where a frame's header names them.
``echo ADDRESS [RING_BYTES [ORDER]]``."""

import asyncio
import sys

import torch

from lamina import transports
from lamina.transports import Frame


async def sender(address: str) -> None:
    conn = await transports.connect(address)
    print("connected", flush=True)
    payload = torch.ones(32 << 20, dtype=torch.uint8)
    while True:
        await conn.send(Frame(1, {}, [payload]))


async def server(address: str) -> None:
    stop = asyncio.Event()

    async def handler(conn) -> None:
        await conn.recv()
        await stop.wait()

    listener = await transports.listen(address, handler)
    print(listener.address, flush=True)
    await stop.wait()


async def echo(address: str, ring_bytes: str | None = None, order: str = "host") -> None:
    async def handler(conn) -> None:
        while True:
            frame = await conn.recv()
            if isinstance(frame.header, dict) and "sleep" in frame.header:
                await asyncio.sleep(frame.header["sleep"])
            await conn.send(frame)

    config = transports.TransportConfig(cuda_ipc_device_order=order == "device")
    if ring_bytes is not None:
        config = config.replace(cuda_ipc_ring_bytes=int(ring_bytes))
    listener = await transports.listen(address, handler, config)
    print(listener.address, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    mode, address, *more = sys.argv[1:]
    asyncio.run({"sender": sender, "server": server, "echo": echo}[mode](address, *more))
