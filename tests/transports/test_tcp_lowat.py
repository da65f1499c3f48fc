"""TCP's low-water mark while a large payload arrives (transports/tcp.py): raised so the
receiver wakes for megabytes, lowered to the rest so the payload's end still wakes it,
and back to 1 for the next frame, however its bytes arrive."""

from __future__ import annotations

import asyncio
import socket

import torch

from lamina import transports
from lamina.transports import Frame, TransportConfig
from lamina.transports.frame import encode
from lamina.transports.tcp import _LARGE_LOWAT

CONFIG = TransportConfig(max_frame_bytes=64 << 20)


def _lowat(conn) -> int:
    return conn._sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)


async def test_a_large_payload_then_a_small_frame_and_the_mark_is_one_again():
    got: asyncio.Queue = asyncio.Queue()

    async def handler(conn) -> None:
        while True:
            try:
                frame = await conn.recv()
            except transports.PeerClosed:
                return
            await got.put((frame, _lowat(conn)))

    listener = await transports.listen("tcp://127.0.0.1:0", handler, CONFIG)
    conn = await transports.connect(listener.address, CONFIG)
    try:
        big = torch.arange(3 * _LARGE_LOWAT // 4 + 13, dtype=torch.int32)  # 3 MiB and a remainder
        await conn.send(Frame(1, {"n": 1}, [big]))
        await conn.send(Frame(2, {"n": 2}))  # right behind it: must not wait on a raised mark
        first, mark = await asyncio.wait_for(got.get(), 30)
        assert torch.equal(first.tensors[0], big) and mark == 1
        second, mark = await asyncio.wait_for(got.get(), 5)
        assert second.header == {"n": 2} and mark == 1
    finally:
        await conn.close()
        await listener.close()


async def test_a_payload_sent_in_slow_pieces_completes():
    """The sender writes a 3 MiB payload in 256 KiB pieces with pauses: the receiver
    (mark raised to 1 MiB, then to what is left) still gets all of it, and no later."""
    received: asyncio.Future = asyncio.get_running_loop().create_future()

    async def handler(conn) -> None:
        received.set_result((await conn.recv()).tensors[0])

    listener = await transports.listen("tcp://127.0.0.1:0", handler, CONFIG)
    payload = torch.randint(0, 255, (3 << 20,), dtype=torch.uint8)
    head, views = encode(Frame(7, {}, [payload]), checksum_payloads=False, max_frame_bytes=CONFIG.max_frame_bytes)
    data = bytes(head) + b"".join(bytes(v) for v in views)
    conn = await transports.connect(listener.address, CONFIG)
    try:
        for start in range(0, len(data), 256 << 10):
            await conn._send_raw(data[start:start + (256 << 10)])  # the frame's bytes, in pieces
            await asyncio.sleep(0.01)
        assert torch.equal(await asyncio.wait_for(received, 30), payload)
    finally:
        await conn.close()
        await listener.close()
