"""cuda_ipc:// (transports/cuda_ipc.py): CUDA tensors between processes through rings of
device memory mapped once per connection. The conformance suite runs it like the other
transports (frames of CPU tensors, errors, timeouts, peers killed); these tests send GPU
tensors, in one process and to a real peer process, host-ordered and device-ordered
(`cuda_ipc_device_order`). They need a CUDA device and skip, saying so, elsewhere."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
import torch
from transport_helpers import address_for, echo

from lamina import transports
from lamina.transports import Frame, TransportConfig

pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(
    transports.availability("cuda_ipc") is not None, reason=f"cuda_ipc: {transports.availability('cuda_ipc')}")]

CHILD = os.path.join(os.path.dirname(__file__), "peer_child.py")
ORDERS = pytest.mark.parametrize("order", ["host", "device"])


def _config(order: str, **more) -> TransportConfig:
    return TransportConfig(cuda_ipc_device_order=order == "device", **more)


def _mixed(seed: int) -> list:
    """GPU tensors of several dtypes and shapes (one empty, one 0-dim), a CPU tensor and bytes."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(64, 9, 128, device="cuda", generator=gen).bfloat16(),
            torch.randn(3, 5, device="cuda", generator=gen),
            torch.randint(0, 1000, (17,), device="cuda", generator=gen),
            torch.empty(0, 4, device="cuda"), torch.tensor(2.5, device="cuda"),
            torch.arange(6.0), b"raw bytes"]


def _same(got: list, sent: list) -> None:
    assert len(got) == len(sent)
    for g, s in zip(got, sent):
        if isinstance(s, torch.Tensor):
            assert g.device.type == s.device.type and g.dtype == s.dtype and g.shape == s.shape
            assert torch.equal(g.cpu(), s.cpu())
        else:
            assert bytes(g) == s


@ORDERS
async def test_gpu_tensors_arrive_on_the_gpu_in_one_process(order):
    listener = await transports.listen(address_for("cuda_ipc"), echo, _config(order))
    conn = await transports.connect(listener.address, _config(order))
    async with listener, conn:
        for i in range(5):
            sent = _mixed(i)
            await conn.send(Frame(3, {"i": i}, sent))
            got = await conn.recv()
            assert got.kind == 3 and got.header == {"i": i}
            _same(got.tensors, sent)


@ORDERS
async def test_the_ring_wraps_and_a_frame_larger_than_it_goes_through_host_memory(order):
    config = _config(order, cuda_ipc_ring_bytes=1 << 20)
    listener = await transports.listen(address_for("cuda_ipc"), echo, config)
    conn = await transports.connect(listener.address, config)
    async with listener, conn:
        # 300 KB a frame, 200 frames in flight four at a time: the 1 MiB ring wraps many times.
        for start in range(0, 200, 4):
            batch = [torch.full((75_000,), float(start + j), device="cuda") for j in range(4)]
            for j, t in enumerate(batch):
                await conn.send(Frame(1, {"n": start + j}, [t]))
            for j, t in enumerate(batch):
                got = await conn.recv()
                assert got.header == {"n": start + j} and torch.equal(got.tensors[0], t)
        big = torch.randn(1 << 19, device="cuda")  # 2 MiB: twice the ring
        await conn.send(Frame(2, {}, [big]))
        got = await conn.recv()
        assert got.tensors[0].is_cuda and torch.equal(got.tensors[0], big)


def _echo_child(*more: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-P", CHILD, "echo", address_for("cuda_ipc"), *more],
                            stdout=subprocess.PIPE, text=True)


@ORDERS
async def test_gpu_tensors_to_a_peer_process_and_back(order):
    """The child maps this process's ring (and events) by their IPC handles and sends back
    from its own: both directions cross processes."""
    child = _echo_child(str(64 << 20), order)
    try:
        address = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 60)
        conn = await transports.connect(address.strip(), _config(order))
        async with conn:
            for i in range(20):
                sent = _mixed(100 + i)
                await conn.send(Frame(1, {"i": i}, sent))
                got = await conn.recv(timeout=30)
                assert got.header == {"i": i}
                _same(got.tensors, sent)
    finally:
        child.kill()
        child.wait()


@ORDERS
async def test_small_rings_wrap_between_processes_and_a_frame_is_read_on_the_callers_stream(order):
    """Both 1 MiB rings wrap many times across processes: each end reuses space only once
    the other's copies out of it are done (space-free frames sent as they finish); device-
    ordered, the 120 frames each way record every event several times. A frame received
    while another stream is current is read there after its copies."""
    child = _echo_child(str(1 << 20), order)
    config = _config(order, cuda_ipc_ring_bytes=1 << 20)
    side = torch.cuda.Stream()
    try:
        address = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 60)
        conn = await transports.connect(address.strip(), config)
        async with conn:
            for start in range(0, 120, 4):
                batch = [torch.full((75_000,), float(start + j), device="cuda") for j in range(4)]
                for j, t in enumerate(batch):
                    await conn.send(Frame(1, {"n": start + j}, [t]))
                for j in range(4):
                    with torch.cuda.stream(side):
                        torch.cuda._sleep(1_000_000)  # the side stream busy while the frame arrives
                        got = await conn.recv(timeout=30)
                        total = got.tensors[0].sum()  # queued on the side stream
                        # Read on the side stream too: the default stream does not wait for it (an
                        # `item()` after the block read the sum's memory before the sum was there).
                        assert got.header == {"n": start + j} and total.item() == 75_000 * (start + j)
    finally:
        child.kill()
        child.wait()


async def test_a_device_ordered_send_does_not_wait_for_the_gpu_and_the_receiver_reads_after_it():
    """Device-ordered, a send returns while the GPU still computes the tensor it carries
    (host-ordered, it would return only once the copies after that work are done), and
    the peer's copy out waits for it on the device: the echo comes back whole."""
    child = _echo_child(str(64 << 20), "device")
    try:
        address = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 60)
        conn = await transports.connect(address.strip(), _config("device"))
        async with conn:
            for i in range(3):
                t = torch.zeros(1 << 20, device="cuda")
                torch.cuda._sleep(400_000_000)  # some 0.2 s of GPU work before the tensor is written
                t.fill_(float(i + 1))
                written = torch.cuda.Event()
                written.record()
                await conn.send(Frame(1, {"i": i}, [t]))
                # Sent before the GPU got to it (from the second frame: the first one's
                # launches may wait for the kernels to load).
                assert i == 0 or not written.query()
                got = await conn.recv(timeout=30)
                assert got.header == {"i": i} and got.tensors[0].sum().item() == (i + 1) * (1 << 20)
    finally:
        child.kill()
        child.wait()


async def test_device_ordered_frames_are_sealed_and_one_its_sender_did_not_seal_is_counted_torn():
    """Each device-ordered frame's seal is read back with it: whole frames count nothing;
    frames whose seals are not what the receiver expects (the sender's salt changed after
    the setup, as a sender that never ran its copies leaves an old seal) count torn."""
    listener = await transports.listen(address_for("cuda_ipc"), echo, _config("host"))
    conn = await transports.connect(listener.address, _config("device"))
    async with listener, conn:
        before = transports.torn_frames()
        for i in range(3):
            await conn.send(Frame(1, {"i": i}, [torch.full((1000,), float(i), device="cuda")]))
            assert (await conn.recv(timeout=30)).tensors[0].sum().item() == 1000 * i
        torch.cuda.synchronize()
        assert transports.torn_frames() == before
        conn._out.salt += 1  # the sender's seals no longer what the receiver expects
        for i in range(3):
            await conn.send(Frame(1, {"i": i}, [torch.full((1000,), float(i), device="cuda")]))
            await conn.recv(timeout=30)
        torch.cuda.synchronize()
        assert transports.torn_frames() == before + 3
