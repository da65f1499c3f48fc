"""RDMA verbs and FHBN: device-independent logic runs everywhere; device tests run where
an RDMA device / CUDA GPU exists and are skipped with the reason otherwise."""

from __future__ import annotations

import ctypes
import struct
import time

import pytest

from lamina.transports import FrameError, fhbn
from lamina.transports.rdma import (
    QpParams,
    RecvWindow,
    SendWindow,
    SlabLayout,
    SlotWrite,
    device_availability,
)
from lamina.transports.rdma_verbs import VerbsEndpoint

pytestmark = pytest.mark.timeout(120)


def params(**kw) -> QpParams:
    base = dict(lid=7, qpn=0x1234, psn=0x42, gid=bytes(range(16)), slab_addr=0x7F00_0000_1000,
                rkey=0xABCD, slot_bytes=4096, num_slots=8, mtu=3)
    base.update(kw)
    return QpParams(**base)


def test_qp_params_round_trip_and_validation():
    p = params()
    assert QpParams.unpack(p.pack()) == p and len(p.pack()) == QpParams.SIZE
    with pytest.raises(FrameError):
        QpParams.unpack(p.pack()[:-1])
    with pytest.raises(FrameError):
        QpParams.unpack(b"XXXX" + p.pack()[4:])
    bad = bytearray(p.pack())
    struct.pack_into("<I", bad, 44, 100)  # slot_bytes not a multiple of 64
    with pytest.raises(FrameError):
        QpParams.unpack(bytes(bad))
    with pytest.raises(ValueError):
        params(qpn=0)
    with pytest.raises(ValueError):
        params(gid=b"short")


def test_slab_layout_offsets():
    layout = SlabLayout(slot_bytes=256, num_slots=4)
    assert layout.slab_bytes == 1024
    assert [layout.offset_of(s) for s in range(6)] == [0, 256, 512, 768, 0, 256]
    assert [layout.imm_of(s) for s in (0, 3, 4, 5)] == [0, 3, 1 << 16, 1 << 16 | 1]  # lap | slot
    with pytest.raises(ValueError):
        SlabLayout(100, 4)
    with pytest.raises(ValueError):
        SlabLayout(256, 0)


def test_send_window_credits():
    w = SendWindow(SlabLayout(128, 2))
    assert w.reserve(10) == SlotWrite(seq=0, offset=0, length=10, imm=0)
    assert w.reserve(128) == SlotWrite(seq=1, offset=128, length=128, imm=1)
    assert not w.can_send()
    with pytest.raises(RuntimeError):
        w.reserve(1)
    w.on_credit(1)
    assert w.num_free == 1 and w.reserve(1) == SlotWrite(2, 0, 1, 1 << 16)  # slot 0 reused after credit
    with pytest.raises(FrameError):
        w.reserve(129)  # larger than a slot
    with pytest.raises(FrameError):
        w.on_credit(0)  # credits never go back
    with pytest.raises(FrameError):
        w.on_credit(4)  # more than was sent


def test_recv_window_takes_chunks_from_completions_in_order():
    layout = SlabLayout(128, 2)
    send, recv = SendWindow(layout), RecvWindow(layout)
    for n in range(1, 6):  # wraps the slab twice
        write = send.reserve(n)
        assert recv.peek() is None  # whatever the slab holds, no completion, no chunk
        assert recv.on_completion(write.imm, write.length) == write.seq
        assert recv.peek() == (write.offset, n)
        send.on_credit(recv.consume())
    with pytest.raises(FrameError):
        recv.on_completion(layout.imm_of(recv.arrived + 1), 1)  # a chunk skipped
    with pytest.raises(RuntimeError):
        recv.consume()  # nothing completed


@pytest.mark.skipif(device_availability() is not None, reason=f"RDMA verbs: {device_availability()}")
def test_verbs_loopback_write_with_imm():
    from pyverbs.device import get_device_list

    dev = get_device_list()[0].name.decode()
    layout = SlabLayout(4096, 4)
    a, b = VerbsEndpoint(dev, layout), VerbsEndpoint(dev, layout)
    try:
        a.connect(b.local_params())
        b.connect(a.local_params())
        for i in range(8):
            data = f"frame {i}".encode()
            a.post_slot([memoryview(data)], len(data))
            deadline = time.monotonic() + 5
            while (got := b.peek_slot()) is None:
                assert time.monotonic() < deadline, "no completion for the write"
            assert got == data
            a.send.on_credit(b.consume_slot())
            a.drain_completions()
        assert b.rq.outstanding == layout.num_slots  # every completion's receive re-posted
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(fhbn.find_nvcc() is None, reason="nvcc not installed (pip install 'lamina[dev]')")
def test_fhbn_compiles_with_nvcc(tmp_path):
    lib_path = fhbn.build(tmp_path, archs=("80",))
    lib = fhbn.load(lib_path)  # loads without a GPU: cudart is static, the driver lazy
    for name in fhbn.EXPORTS:
        assert hasattr(lib, name)
    assert lib.fhbn_proxy_req_size() == 40 and lib.fhbn_sq_size() == 40
    assert fhbn.PROXY_REQ.itemsize == lib.fhbn_proxy_req_size()  # the host proxy's view of it


@pytest.mark.skipif(fhbn.device_availability() is not None, reason=f"FHBN: {fhbn.device_availability()}")
@pytest.mark.skipif(fhbn.find_nvcc() is None, reason="nvcc not installed")
def test_fhbn_device_side_polling(tmp_path):
    import torch

    lib = fhbn.load(fhbn.build(tmp_path))
    seq = torch.zeros(1, dtype=torch.int64, device="cuda")
    observed = torch.zeros(1, dtype=torch.int64, device="cuda")
    waiter, producer = torch.cuda.Stream(), torch.cuda.Stream()
    # The wait kernel is queued first; a consumer queued behind it must see the value.
    assert lib.fhbn_wait_seq(ctypes.c_void_p(seq.data_ptr()), 5, ctypes.c_void_p(observed.data_ptr()),
                             ctypes.c_void_p(waiter.cuda_stream)) == 0
    with torch.cuda.stream(waiter):
        consumer = observed + 1
    time.sleep(0.05)
    assert not waiter.query(), "the wait kernel returned before the sequence number arrived"
    assert lib.fhbn_store_seq(ctypes.c_void_p(seq.data_ptr()), 5, ctypes.c_void_p(producer.cuda_stream)) == 0
    waiter.synchronize()
    assert observed.item() == 5 and consumer.item() == 6


@pytest.mark.skipif(fhbn.device_availability() is not None, reason=f"FHBN: {fhbn.device_availability()}")
@pytest.mark.skipif(fhbn.find_nvcc() is None, reason="nvcc not installed")
def test_fhbn_kernel_enqueues_to_host_proxy(tmp_path):
    """The CUDA kernel publishes write requests into a ring in pinned host memory (seen by
    the GPU through UVA); the host proxy drains them in order and "posts" each by copying
    host bytes (the NIC's part; a real post needs an RDMA device)."""
    import numpy as np
    import torch

    lib = fhbn.load(fhbn.build(tmp_path, archs=("80", "90")))
    slots, n, chunk = 4, 64, 32
    ring_mem = torch.zeros(slots * fhbn.PROXY_REQ.itemsize, dtype=torch.uint8).pin_memory()
    ring = fhbn.ProxyRing(ring_mem.numpy(), slots)
    src = np.arange(n * chunk, dtype=np.uint8)
    dst = np.zeros_like(src)
    posted = []

    def post(laddr, lkey, length, raddr, rkey, imm, wr_id):
        ctypes.memmove(raddr, laddr, length)
        posted.append(imm)

    proxy = fhbn.HostProxy(ring, post)
    proxy.start()
    stream = torch.cuda.Stream()
    try:
        for i in range(n):  # more requests than slots: the kernel waits for drained slots
            assert lib.fhbn_launch_proxy_enqueue(
                ctypes.c_void_p(ring_mem.data_ptr()), slots, i, src.ctypes.data + i * chunk, 1, chunk,
                dst.ctypes.data + i * chunk, 2, i, ctypes.c_void_p(stream.cuda_stream)) == 0
        stream.synchronize()
        deadline = time.monotonic() + 10
        while proxy.posted < n and time.monotonic() < deadline:
            time.sleep(0.001)
    finally:
        proxy.stop()
    assert posted == list(range(n)) and np.array_equal(dst, src)
