"""ucx:// sending CUDA tensors from device memory (transports/ucx.py): a notice, the frame
with those places left empty, then one UCX message per tensor from its own memory.

Here, with no GPU, the same protocol runs over host memory: the tests make every
non-empty tensor of a frame travel that way (the predicate that picks CUDA tensors,
`_sends_direct`, and the check that UCX can send device memory, replaced), over real
UCX endpoints, and count the notices the receiver read. With CUDA present, the
conformance suite's test_cuda_tensors_arrive_whole sends CUDA tensors that way as they
are and checks they arrive on the receiver's GPU.
"""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import torch
from transport_helpers import address_for, echo

from lamina import transports
from lamina.transports import Frame, FrameError, TransportConfig, ucx

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(transports.availability("ucx") is not None,
                                 reason=f"ucx unavailable: {transports.availability('ucx')}")]


@pytest.fixture
def notices(monkeypatch) -> list[int]:
    """Every non-empty CPU tensor travels as device memory would; the number of tensors
    each notice the receivers read announced."""
    monkeypatch.setattr(ucx, "_device_memory", lambda ucxx, config: config.ucx_device_memory)
    monkeypatch.setattr(ucx, "_sends_direct", lambda t: isinstance(t, torch.Tensor) and t.numel() > 0)
    read = ucx._read_notice
    seen: list[int] = []

    def counted(header):
        items = read(header)
        seen.append(len(items))
        return items

    monkeypatch.setattr(ucx, "_read_notice", counted)
    return seen


def _frames() -> list[Frame]:
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(300, 257, generator=gen)  # past one UCX message of a frame (64 KiB)
    return [
        Frame(3, {"step": 1}, [torch.randn(4, 9, 64, generator=gen).bfloat16(), torch.arange(5), b"raw bytes"]),
        Frame(4, {"big": True}, [big, big.t(), torch.empty(0, 3)]),  # non-contiguous; empty stays in the frame
        Frame(5, ["no", "tensors"], []),
        Frame(6, {}, [torch.tensor(7, dtype=torch.int32), torch.ones(2, 2, dtype=torch.bool)]),
    ]


def _same(got: Frame, sent: Frame) -> None:
    assert (got.kind, got.header, len(got.tensors)) == (sent.kind, sent.header, len(sent.tensors))
    for g, s in zip(got.tensors, sent.tensors):
        if isinstance(s, torch.Tensor):
            assert g.dtype == s.dtype and g.shape == s.shape and torch.equal(g.cpu(), s)
        else:
            assert bytes(g) == s


async def test_frames_round_trip_with_their_tensors_sent_as_messages_of_their_own(notices):
    listener = await transports.listen(address_for("ucx"), echo)
    conn = await transports.connect(listener.address)
    async with listener, conn:
        assert not conn.stages_cuda
        for frame in _frames() * 2:
            await conn.send(frame)
            _same(await conn.recv(), frame)
    # Both ways (the echo's sends too), for each frame with a non-empty tensor: 2, 2, -, 2.
    assert notices == [2, 2, 2, 2, 2, 2] * 2


async def test_received_into_the_callers_out_buffers(notices):
    listener = await transports.listen(address_for("ucx"), echo)
    conn = await transports.connect(listener.address)
    async with listener, conn:
        sent = Frame(3, {}, [torch.arange(6, dtype=torch.float32), b"abc", torch.arange(4)])
        out = [torch.empty(6), bytearray(3), None]
        await conn.send(sent)
        got = await conn.recv(out=out)
        assert got.tensors[0] is out[0] and got.tensors[1] is out[1]
        _same(got, sent)
        await conn.send(sent)
        with pytest.raises(FrameError, match="out buffer 0"):
            await conn.recv(out=[torch.empty(5)])
    assert notices[:2] == [2, 2]


async def test_a_frame_over_the_bound_is_refused_before_anything_is_sent(notices):
    config = TransportConfig(max_frame_bytes=64 * 1024)
    listener = await transports.listen(address_for("ucx"), echo, config)
    conn = await transports.connect(listener.address, config)
    async with listener, conn:
        with pytest.raises(FrameError, match="exceeds max_frame_bytes"):
            await conn.send(Frame(1, {}, [torch.zeros(20_000)]))  # 80,000 bytes
        small = Frame(2, {"after": 1}, [torch.ones(3)])
        await conn.send(small)
        _same(await conn.recv(), small)
    assert notices == [1, 1]


@pytest.mark.parametrize(("items", "error"), [
    (b"\xc1", "malformed"),  # not msgpack
    (msgpack.packb([[0, "float33", [2]]]), "malformed"),
    (msgpack.packb([[0, "float32", [-1]]]), "malformed"),
    (msgpack.packb([[0, "float32", [2]], [0, "int64", [1]]]), "twice"),
    (msgpack.packb([[3, "float32", [2]]]), "does not leave empty"),
    (msgpack.packb([[0, "float32", [1 << 63, 0]]]), "malformed"),  # no bytes, and a shape torch refuses
    (msgpack.packb([[0, "float32", [1 << 40, 1 << 40, 0]]]), "malformed"),
])
async def test_a_malformed_notice_is_a_frame_error(notices, items, error):
    """A notice that cannot be read, or that names a place the frame after it fills, is
    refused as a corrupted frame is."""
    listener = await transports.listen(address_for("ucx"), None)
    conn = await transports.connect(listener.address)
    async with listener, conn:
        server = await listener.accept()
        async with server:
            conn.stages_cuda = True  # this end sends both frames as they are
            await conn.send(Frame(0, msgpack.ExtType(ucx._DIRECT, items), []))
            await conn.send(Frame(1, {}, [torch.ones(2), b"", b"", torch.ones(1)]))
            with pytest.raises(FrameError, match=error):
                await server.recv()


def test_device_memory_only_where_asked_cuda_is_present_and_ucx_may_use_it(monkeypatch):
    """`_device_memory`: off when asked so, without a CUDA device, or with UCX_TLS naming
    host transports alone; on where ucxx reports CUDA support (this UCX build does)."""
    ucxx = ucx._ucxx(TransportConfig())
    monkeypatch.delenv("UCX_TLS", raising=False)
    assert not ucx._device_memory(ucxx, TransportConfig(ucx_device_memory=False))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not ucx._device_memory(ucxx, TransportConfig())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert ucx._device_memory(ucxx, TransportConfig()) == ucxx.core._get_ctx().context.cuda_support
    assert ucxx.core._get_ctx().context.cuda_support
    monkeypatch.setenv("UCX_TLS", "tcp,sm,self")
    assert not ucx._device_memory(ucxx, TransportConfig())
    monkeypatch.setenv("UCX_TLS", "tcp,cuda_copy")
    assert ucx._device_memory(ucxx, TransportConfig())


async def test_conjugated_and_negated_views_travel_as_their_values(notices):
    """A tensor with torch's lazy conjugate or negative bit is sent as the values it
    stands for (a byte view of it would be refused)."""
    gen = torch.Generator().manual_seed(1)
    c = torch.randn(5, dtype=torch.complex64, generator=gen)
    conj, neg = c.conj(), c.conj().imag  # conj bit; the imaginary part of a conjugate: neg bit
    assert conj.is_conj() and neg.is_neg()
    listener = await transports.listen(address_for("ucx"), echo)
    conn = await transports.connect(listener.address)
    async with listener, conn:
        await conn.send(Frame(1, {}, [conj, neg]))
        got = await conn.recv()
    assert torch.equal(got.tensors[0], conj.resolve_conj()) and not got.tensors[0].is_conj()
    assert torch.equal(got.tensors[1], neg.resolve_neg())
    assert notices == [2, 2]


def test_device_payloads_arrive_on_the_gpu_only_in_a_process_computing_there(monkeypatch):
    """`_receive_device`: host memory where this end stages CUDA tensors (its UCX cannot
    take device memory) or has not started CUDA (a CPU service on a GPU host); else the
    current CUDA device."""
    class Ep:
        async def recv(self, view):
            raise AssertionError("not called")

    conn = ucx.UcxConnection(Ep(), TransportConfig(), "peer")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    conn.stages_cuda = False
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert conn._receive_device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert conn._receive_device() == torch.device("cuda", 1)
    conn.stages_cuda = True
    assert conn._receive_device() == torch.device("cpu")


@pytest.mark.parametrize("failure", [asyncio.CancelledError, RuntimeError])
async def test_a_receive_given_up_keeps_its_buffer(failure):
    """A receive that is cancelled or fails keeps its buffer alive with the connection:
    UCX cannot cancel a receive already matched, and may still write into it."""
    class Ep:
        async def recv(self, view):
            raise failure("gone mid-message")

    conn = ucx.UcxConnection(Ep(), TransportConfig(), "peer")
    buf = torch.zeros(16)
    view = ucx._bytes_of(buf)
    with pytest.raises(asyncio.CancelledError if failure is asyncio.CancelledError else transports.PeerClosed):
        await conn._read_exact(view)
    assert conn._orphans == [view]
    del buf, view
    assert conn._orphans[0].nbytes == 64  # the memory is still held
