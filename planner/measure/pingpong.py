"""A transport's round trip and bandwidth between two processes on this machine.

The client sends a payload of S bytes, the server (a spawned process) echoes it, both
sides receive into preallocated buffers taken from the heap (`heap_buffers`). `rtt_us` is
the median round trip; `gbps` is 2 * S * 8 / median round trip (bytes moved both ways),
in Gbit/s. `lamina profile` measures every transport this machine runs with `pingpong`
(planner/profile.py); bench/transport_pingpong.py measures them beside raw sockets, Gloo
and memcpy, timed with the same rounds.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

    from lamina.transports import TransportConfig


def iterations(size: int, quick: bool) -> int:
    """Timed round trips for one size (fixed, so both sides of gloo know the count)."""
    if size <= 16384:
        return 300 if quick else 2000
    if size <= (1 << 20):
        return 40 if quick else 200
    return 4 if quick else 10


def warmup_rounds(size: int) -> int:
    return 3 if size < (16 << 20) else 1


def measure(one_round: Callable[[], object], size: int, quick: bool) -> float:
    """Median seconds of `one_round` after its warm-up rounds."""
    for _ in range(warmup_rounds(size)):
        one_round()
    times = []
    for _ in range(iterations(size, quick)):
        t0 = time.perf_counter()
        one_round()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def ameasure(one_round: Callable[[], Awaitable[object]], size: int, quick: bool) -> float:
    """`measure` for a coroutine function."""
    for _ in range(warmup_rounds(size)):
        await one_round()
    times = []
    for _ in range(iterations(size, quick)):
        t0 = time.perf_counter()
        await one_round()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def heap_buffers() -> None:
    """Every process here takes large buffers from the heap. glibc maps each allocation
    above its mmap threshold (128 KiB at first) on its own, and raises the threshold only
    when such a mapping is freed: so in a fresh process the first contender's 16 MiB
    buffers were mappings of their own and the later contenders' heap memory, and copies
    into the mappings were slower here (16 MiB TCP round trip 16 ms first in a process, 13
    ms after; raw socket 12 ms against 7.7 ms with both on the heap). Fixing the thresholds
    gives every contender the same kind of memory whatever ran before it."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallopt"):  # not glibc
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 512 << 20)  # the largest size measured is 64 MiB
    libc.mallopt(m_trim_threshold, 1 << 30)  # and freed buffers stay for the next contender


def one_thread() -> None:
    """Every process here moves bytes on one core: idle OpenMP workers left spinning
    after a parallel op (filling a 64 MiB payload) would take the CPU the peer needs."""
    import torch

    torch.set_num_threads(1)


def figures(rtts: dict[int, float]) -> dict[str, dict[str, float]]:
    """Round trips in microseconds and bandwidths in Gbit/s, keyed by size as text."""
    return {
        "rtt_us": {str(s): round(t * 1e6, 2) for s, t in rtts.items()},
        "gbps": {str(s): round(2 * s * 8 / t / 1e9, 3) for s, t in rtts.items()},
    }


def transport_config(native: bool = True) -> TransportConfig:
    """The transports' default configuration, with frames up to 1 GiB."""
    from lamina.transports import TransportConfig

    return TransportConfig(max_frame_bytes=(1 << 30), native_frames=native)


def _serve(address: str, ready: Queue[Any], native: bool) -> None:
    """The echo server, in its own process: one connection, until its peer closes it."""
    heap_buffers()
    import torch

    one_thread()
    from lamina import transports
    from lamina.aio import install_uvloop

    async def main() -> None:
        done = asyncio.Event()

        async def echo(conn: Any) -> None:
            out = None
            try:
                while True:
                    frame = await conn.recv(out=out)
                    if frame.kind == 0:  # size change: preallocate the next receives
                        size = frame.header["size"]
                        out = [torch.empty(size, dtype=torch.uint8)]
                        await conn.send(frame)
                        continue
                    await conn.send(frame)
            except transports.PeerClosed:
                done.set()

        listener = await transports.listen(address, echo, transport_config(native))
        ready.put(listener.address)
        await done.wait()
        await listener.close()

    install_uvloop()
    asyncio.run(main())


def loopback_address(scheme: str) -> str:
    """Where a pingpong's echo process listens for `scheme` on this host (rdma and fhbn
    name a verbs device: pingpong finds theirs). cuda_ipc's frames of host memory travel
    through its shm connection: that path is what a pingpong measures there (its device
    path: device_profile's device_round_trips)."""
    addresses = {"tcp": "tcp://127.0.0.1:0", "ucx": "ucx://127.0.0.1:0", "shm": f"shm://bench-{os.getpid()}",
                 "cuda_ipc": f"cuda_ipc://bench-{os.getpid()}"}
    if scheme not in addresses:
        raise ValueError(f"pingpong: no loopback address for {scheme!r} (known: {', '.join(addresses)})")
    return addresses[scheme]


def pingpong(name: str, sizes: list[int], quick: bool) -> dict[str, dict[str, float]]:
    """``name``: a scheme, or ``<scheme>+py`` for that transport with the Python codec;
    its `figures` at each of `sizes`."""
    import torch

    one_thread()
    from lamina import transports
    from lamina.aio import install_uvloop
    from lamina.transports import Frame

    scheme, _, codec = name.partition("+")
    native = codec != "py"
    if scheme in ("rdma", "fhbn"):  # first verbs device, port 1, control socket on loopback
        from pyverbs.device import get_device_list
        address = f"{scheme}://{get_device_list()[0].name.decode()}/1/127.0.0.1:0"
    else:
        address = loopback_address(scheme)
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    server = ctx.Process(target=_serve, args=(address, ready, native), daemon=True)
    server.start()
    address = ready.get(timeout=60)

    async def main() -> dict[int, float]:
        conn = await transports.connect(address, transport_config(native))
        rtts = {}
        for size in sizes:
            payload = torch.randint(0, 255, (size,), dtype=torch.uint8)
            out = [torch.empty(size, dtype=torch.uint8)]
            await conn.send(Frame(0, {"size": size}))
            await conn.recv()
            frame = Frame(1, {}, [payload])

            async def one_round(frame: Frame = frame, out: list[torch.Tensor] = out) -> None:
                await conn.send(frame)
                await conn.recv(out=out)

            rtts[size] = await ameasure(one_round, size, quick)
            assert torch.equal(out[0], payload)
        await conn.close()
        return rtts

    install_uvloop()
    rtts = asyncio.run(main())
    server.join(30)
    if server.is_alive():
        server.kill()
    return figures(rtts)
