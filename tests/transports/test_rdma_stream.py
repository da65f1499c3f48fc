"""The rdma:// connection logic (slot stream, credits, SLEEP/BELL wake-ups, control socket,
QP parameter exchange) without a device: ``HostSlabEndpoint`` does in host memory what
the NIC does for one RDMA WRITE WITH IMMEDIATE (the bytes into the peer's slab, then a
completion on the peer's receive queue that uses up one of its posted receive requests);
everything else is the production code. The FHBN host proxy drains a real descriptor
ring in host memory and "posts" by copying bytes between buffers."""

from __future__ import annotations

import asyncio
import ctypes
import socket
import threading
import time

import numpy as np
import pytest
import torch

from lamina import transports
from lamina.transports import AuthError, Frame, PeerClosed, TransportConfig, TransportTimeout, TransportUnavailable
from lamina.transports.fhbn import PROXY_REQ, HostProxy, ProxyRing
from lamina.transports.rdma import (
    QpParams,
    SlabLayout,
    SlotStream,
    SlotWrite,
    chunk_capacity,
    parse_rdma_address,
    split_chunks,
)
from lamina.transports.rdma_transport import establish

pytestmark = pytest.mark.timeout(60)

_next_qpn = iter(range(1, 1 << 20))


class HostSlabEndpoint(SlotStream):
    """A slot-stream endpoint in host memory (the NIC's part of one WRITE WITH IMM).

    ``hold_completions``: writes into this endpoint place their bytes at once but keep
    their completions in ``held`` until a test releases them (placement before
    completion, as a NIC may do)."""

    def __init__(self, layout: SlabLayout) -> None:
        super().__init__(layout)
        self.slab = bytearray(layout.slab_bytes)
        self.peer: HostSlabEndpoint | None = None
        self.qpn = next(_next_qpn)
        self.completions: list[tuple[int, int]] = []  # (immediate, byte length), not yet polled
        self.held: list[tuple[int, int]] = []
        self.hold_completions = False
        self.posted_recvs = 0  # receive requests the "NIC" holds for this endpoint
        self.writes: list[int] = []  # lengths of the writes this endpoint posted
        self.closed = False

    # What establish() needs: parameters out, connect to the peer's.
    def local_params(self) -> QpParams:
        return QpParams(lid=1, qpn=self.qpn, psn=0, gid=bytes(16), slab_addr=id(self.slab),
                        rkey=self.qpn, slot_bytes=self.layout.slot_bytes, num_slots=self.layout.num_slots,
                        mtu=5)

    def connect(self, peer: QpParams) -> None:
        self.peer = _REGISTRY[peer.qpn]
        self.fill_receive_queue()

    def _post_write(self, write: SlotWrite, data: bytes) -> None:
        peer = self.peer
        assert peer is not None and len(data) == write.length
        self.writes.append(write.length)
        peer.slab[write.offset:write.offset + write.length] = data
        # The protocol keeps a receive request posted for every write that may arrive:
        # a write that found none would be a receiver-not-ready retry on a real NIC.
        assert peer.posted_recvs > 0, "write with immediate found no posted receive request"
        peer.posted_recvs -= 1
        (peer.held if peer.hold_completions else peer.completions).append((write.imm, write.length))

    def _poll_recv(self) -> list[tuple[int, int]]:
        out, self.completions = self.completions, []
        return out

    def _post_recv(self, n: int) -> None:
        self.posted_recvs += n
        assert self.posted_recvs <= self.layout.num_slots  # the receive queue's depth

    def release_held(self) -> None:
        self.completions += self.held
        self.held.clear()

    def _slab_read(self, nbytes: int, offset: int) -> bytes:
        return bytes(self.slab[offset:offset + nbytes])

    def drain_completions(self) -> int:
        return 0  # sends complete at once here

    def close(self) -> None:
        self.closed = True


_REGISTRY: dict[int, HostSlabEndpoint] = {}


def _endpoint(layout: SlabLayout) -> HostSlabEndpoint:
    ep = HostSlabEndpoint(layout)
    _REGISTRY[ep.qpn] = ep
    return ep


DEFAULT_LAYOUT = SlabLayout(4096, 8)  # frozen: safe to share as a default


async def rdma_pair(layout=DEFAULT_LAYOUT, server_cfg=None, client_cfg=None):
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    server_cfg, client_cfg = server_cfg or TransportConfig(), client_cfg or TransportConfig()
    return await asyncio.gather(
        establish(a, _endpoint(layout), server_cfg, is_server=True, peer="server-side"),
        establish(b, _endpoint(layout), client_cfg, is_server=False, peer="client-side"))


def test_address_and_chunking():
    assert parse_rdma_address("rdma://mlx5_0/1/10.0.0.2:5555") == ("mlx5_0", 1, "10.0.0.2", 5555)
    assert parse_rdma_address("fhbn://mlx5_1/2/[::1]:7") == ("mlx5_1", 2, "::1", 7)
    for bad in ("rdma://mlx5_0/10.0.0.2:5555", "rdma://mlx5_0/0/h:1", "rdma://mlx5_0/1/host"):
        with pytest.raises(ValueError):
            parse_rdma_address(bad)
    views = [memoryview(b"a" * 5), memoryview(b""), memoryview(b"b" * 7)]
    chunks = split_chunks(views, 4)
    assert [n for _, n in chunks] == [4, 4, 4]
    assert b"".join(b"".join(bytes(v) for v in c) for c, _ in chunks) == b"a" * 5 + b"b" * 7
    assert chunk_capacity(SlabLayout(128, 2)) == 128  # the length travels with the completion


async def test_unavailable_schemes_say_why():
    for scheme in ("rdma", "fhbn"):
        reason = transports.availability(scheme)
        if reason is None:
            pytest.skip(f"{scheme} is available here")
        assert reason
        with pytest.raises(TransportUnavailable, match=reason.split("(")[0].strip()):
            await transports.listen(f"{scheme}://mlx5_0/1/127.0.0.1:0")
        with pytest.raises(TransportUnavailable):
            await transports.connect(f"{scheme}://mlx5_0/1/127.0.0.1:1")


async def test_frames_of_every_size_cross_slots_in_order():
    server, client = await rdma_pair()
    try:
        payloads = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in (1, 1000, 4085, 4096, 100_000)]
        payloads.append(torch.randn(64, 33))
        sent = []
        for i, p in enumerate(payloads):  # the 100 kB frame needs 25 slots of an 8-slot slab:
            frame = Frame(i, {"i": i}, [p, b"tail"])  # the sender waits for credits
            send = asyncio.create_task(client.send(frame))
            got = await server.recv()
            await send
            sent.append(i)
            assert got.kind == i and got.header == {"i": i}
            assert torch.equal(got.tensors[0], p) and bytes(got.tensors[1]) == b"tail"
        await server.send(Frame(9, {"back": True}, [torch.arange(10)]))
        back = await client.recv()
        assert back.header == {"back": True} and torch.equal(back.tensors[0], torch.arange(10))
    finally:
        await client.close()
        await server.close()


async def test_pipelined_small_frames_with_sleeping_receiver():
    server, client = await rdma_pair(SlabLayout(256, 4))
    n = 500

    async def produce():
        for i in range(n):
            await client.send(Frame(2, {"i": i}, [b"x" * (i % 300)]))
            if i % 50 == 0:
                await asyncio.sleep(0.005)  # let the receiver run dry and sleep (SLEEP/BELL)

    try:
        producer = asyncio.create_task(produce())
        for i in range(n):
            f = await server.recv()
            assert f.header["i"] == i and bytes(f.tensors[0]) == b"x" * (i % 300)
        await producer
        assert server._ep.recv.next_seq == client._ep.send.next_seq  # every slot consumed
        # One receive request re-posted per completion taken: the queue is full again.
        assert server._ep.posted_recvs == server._ep.rq.outstanding == 4
        # Each write carries the chunk's bytes, not the slot: a frame of a few bytes is a
        # short write, a frame of more than a slot fills whole slots and then a short one.
        assert min(client._ep.writes) < 64 and max(client._ep.writes) == 256
    finally:
        await client.close()
        await server.close()


async def test_backpressure_bounds_the_sender():
    server, client = await rdma_pair(SlabLayout(4096, 4), client_cfg=TransportConfig(send_timeout=0.3))
    try:
        with pytest.raises(TransportTimeout):
            await client.send(Frame(1, {}, [torch.zeros(1 << 20, dtype=torch.uint8)]))
        assert client._ep.send.next_seq == 4  # exactly the receiver's slab, then it waited
        assert client.closed
    finally:
        await client.close()
        await server.close()


async def test_peer_close_is_reported_and_recv_timeout_keeps_connection():
    server, client = await rdma_pair(client_cfg=TransportConfig(recv_timeout=0.1))
    try:
        with pytest.raises(TransportTimeout):
            await client.recv()
        await server.send(Frame(1, {"after": "timeout"}))
        assert (await client.recv()).header == {"after": "timeout"}
        waiting = asyncio.create_task(server.recv())
        await asyncio.sleep(0.05)
        await client.close()
        with pytest.raises(PeerClosed):
            await asyncio.wait_for(waiting, 5)
    finally:
        await client.close()
        await server.close()


async def test_a_frame_is_delivered_by_its_completion_not_by_its_bytes():
    server, client = await rdma_pair(server_cfg=TransportConfig(recv_timeout=0.2))
    try:
        server._ep.hold_completions = True
        await client.send(Frame(3, {"held": True}, [b"payload"]))
        assert b"payload" in server._ep.slab  # placed...
        with pytest.raises(TransportTimeout):
            await server.recv()  # ...but not complete: nothing is delivered
        server._ep.release_held()
        got = await server.recv()
        assert got.header == {"held": True} and bytes(got.tensors[0]) == b"payload"
    finally:
        await client.close()
        await server.close()


async def test_parameter_exchange_checks_the_token():
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    layout = SlabLayout(4096, 8)
    results = await asyncio.gather(
        establish(a, _endpoint(layout), TransportConfig(auth_token="secret"), is_server=True, peer="s"),
        establish(b, _endpoint(layout), TransportConfig(auth_token="wrong"), is_server=False, peer="c"),
        return_exceptions=True)
    assert all(isinstance(r, AuthError) for r in results), results
    a.close()
    b.close()


def test_host_proxy_drains_a_real_descriptor_ring_in_order():
    """A producer thread enqueues write requests the way the CUDA kernel does (slot free ->
    fields -> seq last); the proxy thread drains them and "posts" each by copying bytes
    from the source buffer to the destination (the NIC's part), in order."""
    assert PROXY_REQ.itemsize == 40  # == fhbn_proxy_req_size() (checked by the build test)
    ring = ProxyRing.allocate(8)
    n, chunk = 1000, 64
    src = np.arange(n * chunk, dtype=np.uint32).view(np.uint8)[: n * chunk].copy()
    dst = np.zeros_like(src)
    posted: list[tuple[int, int]] = []

    def post(laddr, lkey, length, raddr, rkey, imm, wr_id):
        assert (lkey, rkey) == (11, 22)
        ctypes.memmove(raddr, laddr, length)
        posted.append((imm, wr_id))

    proxy = HostProxy(ring, post)
    proxy.start()

    def produce():
        for i in range(n):
            while not ring.try_enqueue(i, src.ctypes.data + i * chunk, 11, chunk,
                                       dst.ctypes.data + i * chunk, 22, i % 8):
                pass  # the slot is not drained yet: the ring bounds the producer

    producer = threading.Thread(target=produce)
    producer.start()
    producer.join(30)
    deadline = time.monotonic() + 30
    while proxy.posted < n and time.monotonic() < deadline:
        time.sleep(0.001)
    proxy.stop()
    assert proxy.posted == n and posted == [(i % 8, i) for i in range(n)]
    assert np.array_equal(dst, src)
    assert not ring.reqs["seq"].any()  # every slot freed


def test_host_proxy_reports_post_failures():
    ring = ProxyRing.allocate(2)

    def post(*args):
        raise RuntimeError("ibv_post_send failed")

    proxy = HostProxy(ring, post)
    proxy.start()
    assert ring.try_enqueue(0, 0, 0, 0, 0, 0, 0)
    deadline = time.monotonic() + 10
    while proxy.error is None and time.monotonic() < deadline:
        time.sleep(0.001)
    with pytest.raises(RuntimeError, match="ibv_post_send"):
        proxy.stop()
    assert ring.reqs["seq"][0] == 1 and proxy.posted == 0  # not posted: the slot stays taken
    assert not ring.try_enqueue(2, 0, 0, 0, 0, 0, 0)
