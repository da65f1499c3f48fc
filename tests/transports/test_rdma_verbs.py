"""The verbs path of rdma:// without a device.

First the pure parts (immediate encoding, MTU mapping, write sizing, completion and
receive-queue bookkeeping); then ``VerbsEndpoint`` itself over a stand-in for pyverbs
(``FakeNic``: the classes and call signatures ``VerbsEndpoint`` uses, copied from
rdma-core's pyverbs, behind a NIC that copies bytes between registered buffers and
queues completions). The stand-in checks what a device would refuse (a write with no
receive request posted, a send queue or completion queue overrun, a write outside the
peer's registered slab); it does not prove pyverbs or a device behave as it does.
"""

from __future__ import annotations

import asyncio
import ctypes
import socket
import struct
import sys
import types
from types import SimpleNamespace

import pytest

from lamina.transports import Frame, FrameError, TransportConfig
from lamina.transports.rdma import (
    MTU_BYTES,
    QpParams,
    RecvWindow,
    SendWindow,
    SlabLayout,
    SlotStream,
    SlotWrite,
    WorkQueue,
    decode_imm,
    encode_imm,
    mtu_bytes,
    path_mtu,
)
from lamina.transports.rdma_transport import establish
from lamina.transports.rdma_verbs import VerbsEndpoint, _verbs_enums

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------- pure parts
def test_immediate_round_trip_and_bounds():
    for slot, lap in [(0, 0), (1, 0), (65535, 0), (7, 1), (65535, 65535), (3, 65536 + 5)]:
        assert decode_imm(encode_imm(slot, lap)) == (slot, lap % 65536)
        assert 0 <= encode_imm(slot, lap) < 1 << 32
    for slot, lap in [(-1, 0), (65536, 0), (0, -1)]:
        with pytest.raises(ValueError):
            encode_imm(slot, lap)
    for imm in (-1, 1 << 32):
        with pytest.raises(FrameError):
            decode_imm(imm)
    layout = SlabLayout(64, 3)  # 3 slots: the lap tells chunk 1 from chunk 4
    assert [decode_imm(layout.imm_of(s)) for s in range(7)] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1),
                                                               (0, 2)]
    assert decode_imm(SlabLayout(64, 1 << 16).imm_of((1 << 16) - 1)) == (65535, 0)  # the largest slab's last slot


def test_mtu_mapping_from_the_active_mtu():
    assert [mtu_bytes(m) for m in range(1, 6)] == [256, 512, 1024, 2048, 4096] == list(MTU_BYTES.values())
    for bad in (0, 6):
        with pytest.raises(ValueError):
            mtu_bytes(bad)
    assert path_mtu(5, 5) == 5  # InfiniBand both sides: 4096
    assert path_mtu(5, 3) == path_mtu(3, 5) == 3  # one side RoCE under a 1500-byte network: 1024
    with pytest.raises(ValueError):
        path_mtu(5, 0)
    p = QpParams(lid=1, qpn=2, psn=0, gid=bytes(16), slab_addr=0, rkey=1, slot_bytes=64, num_slots=2, mtu=3)
    assert QpParams.unpack(p.pack()).mtu == 3
    bad = bytearray(p.pack())
    struct.pack_into("<I", bad, len(bad) - 4, 7)  # the last field: mtu
    with pytest.raises(FrameError, match="ibv_mtu"):
        QpParams.unpack(bytes(bad))


class RecordingStream(SlotStream):
    """A slot stream whose device operations only record what they were asked."""

    def __init__(self, layout: SlabLayout) -> None:
        super().__init__(layout)
        self.slab = bytearray(layout.slab_bytes)
        self.writes: list[tuple[SlotWrite, bytes]] = []
        self.recv_posts: list[int] = []
        self.completions: list[tuple[int, int]] = []

    def _post_write(self, write: SlotWrite, data: bytes) -> None:
        self.writes.append((write, data))

    def _poll_recv(self) -> list[tuple[int, int]]:
        out, self.completions = self.completions, []
        return out

    def _post_recv(self, n: int) -> None:
        self.recv_posts.append(n)

    def _slab_read(self, nbytes: int, offset: int) -> bytes:
        return bytes(self.slab[offset:offset + nbytes])


def test_a_write_sends_the_bytes_used_not_the_slot():
    s = RecordingStream(SlabLayout(4096, 4))
    for n in (1, 100, 4095, 4096):
        s.post_slot([memoryview(b"x" * (n // 2)), memoryview(b"y" * (n - n // 2))], n)
    assert [w.length for w, _ in s.writes] == [1, 100, 4095, 4096]
    assert [len(d) for _, d in s.writes] == [1, 100, 4095, 4096]
    assert [w.offset for w, _ in s.writes] == [0, 4096, 8192, 12288]
    for n in (0, 4097):
        with pytest.raises(FrameError):
            SendWindow(SlabLayout(4096, 4)).reserve(n)


def test_receive_queue_is_refilled_one_request_per_completion():
    layout = SlabLayout(64, 4)
    s = RecordingStream(layout)
    s.fill_receive_queue()
    assert s.recv_posts == [4] and s.rq.outstanding == 4
    s.fill_receive_queue()  # full: nothing more
    assert s.recv_posts == [4]
    sender = SendWindow(layout)
    for batch in (1, 3, 2):
        writes = [sender.reserve(8) for _ in range(batch)]
        s.completions = [(w.imm, w.length) for w in writes]
        assert s.take_completions() == batch
        assert s.recv_posts[-1] == batch and s.rq.outstanding == s.rq.depth == 4
        for _ in writes:
            sender.on_credit(s.consume_slot())
    assert s.take_completions() == 0 and len(s.recv_posts) == 4  # no completion, no post


def test_a_chunk_exists_only_once_its_completion_arrives():
    layout = SlabLayout(64, 2)
    s = RecordingStream(layout)
    s.fill_receive_queue()
    write = SendWindow(layout).reserve(5)
    s.slab[write.offset:write.offset + 5] = b"early"  # placed, no completion yet
    assert s.peek_slot() is None
    s.completions = [(write.imm, write.length)]
    assert s.peek_slot() == b"early" and s.peek_slot() == b"early"  # peeking takes nothing
    assert s.consume_slot() == 1 and s.peek_slot() is None


def test_recv_window_refuses_a_broken_peer():
    layout = SlabLayout(64, 2)
    for imm, nbytes, match in [(layout.imm_of(1), 8, "slot 1"), (encode_imm(0, 1), 8, "lap 1"),
                               (layout.imm_of(0), 0, "0 bytes"), (layout.imm_of(0), 65, "65 bytes")]:
        with pytest.raises(FrameError, match=match):
            RecvWindow(layout).on_completion(imm, nbytes)
    recv = RecvWindow(layout)
    recv.on_completion(layout.imm_of(0), 8)
    recv.on_completion(layout.imm_of(1), 8)
    with pytest.raises(FrameError, match="no credit"):
        recv.on_completion(layout.imm_of(2), 8)  # slot 0 is still unread


def test_work_queue_bounds():
    q = WorkQueue(3)
    q.on_posted(3)
    with pytest.raises(RuntimeError):
        q.on_posted(1)
    q.on_completed(2)
    assert q.room == 2 and q.outstanding == 1
    with pytest.raises(FrameError):
        q.on_completed(2)
    with pytest.raises(ValueError):
        WorkQueue(0)


# ---------------------------------------------------------------- VerbsEndpoint on a stand-in
ENUMS = {  # values from infiniband/verbs.h
    "ibv_access_flags": {"IBV_ACCESS_LOCAL_WRITE": 1, "IBV_ACCESS_REMOTE_WRITE": 2},
    "ibv_qp_type": {"IBV_QPT_RC": 2},
    "ibv_qp_state": {"IBV_QPS_RESET": 0, "IBV_QPS_INIT": 1},
    "ibv_wr_opcode": {"IBV_WR_RDMA_WRITE_WITH_IMM": 1},
    "ibv_send_flags": {"IBV_SEND_SIGNALED": 2},
    "ibv_wc_status": {"IBV_WC_SUCCESS": 0},
    "ibv_wc_opcode": {"IBV_WC_RECV_RDMA_WITH_IMM": 129},
}
RESET, INIT, RTR, RTS = range(4)


class FakeNic:
    """Registered buffers by rkey, queue pairs by number, and what was asked of them."""

    def __init__(self, active_mtu: dict[str, int]) -> None:
        self.active_mtu = active_mtu
        self.mrs: dict[int, object] = {}
        self.qps: dict[int, object] = {}
        self.sge_lengths: list[int] = []
        self.wire_imms: list[int] = []
        self.hold: set[int] = set()  # QP numbers whose receive completions wait in `held`
        self.held: list[tuple[object, object]] = []

    def release(self) -> None:
        for cq, wc in self.held:
            cq.push(wc)
        self.held.clear()

    def modules(self) -> dict[str, types.ModuleType]:
        nic = self

        class Context:
            def __init__(self, name: str) -> None:
                self.mtu = nic.active_mtu[name]

            def query_port(self, port: int):
                return SimpleNamespace(lid=7, active_mtu=self.mtu)

            def query_gid(self, port: int, index: int) -> str:  # str(GID) is this form
                return "fe80:0000:0000:0000:0000:0000:0000:0001"

            def close(self) -> None: ...

        class PD:
            def __init__(self, ctx) -> None: ...
            def close(self) -> None: ...

        class MR:
            def __init__(self, pd, length: int, access: int) -> None:
                self._mem = (ctypes.c_char * length)()
                self.buf, self.length, self.access = ctypes.addressof(self._mem), length, access
                self.lkey = self.rkey = len(nic.mrs) + 1
                nic.mrs[self.rkey] = self

            def write(self, data, length: int, offset: int = 0) -> None:
                assert offset + length <= self.length
                ctypes.memmove(self.buf + offset, bytes(data), length)

            def read(self, length: int, offset: int) -> bytes:
                return ctypes.string_at(self.buf + offset, length)

            def close(self) -> None: ...

        class CQ:
            def __init__(self, context, cqe, cq_context, channel, comp_vector) -> None:  # all positional
                self.cqe, self.wcs = cqe, []

            def push(self, wc) -> None:
                assert len(self.wcs) < self.cqe, "completion queue overrun"
                self.wcs.append(wc)

            def poll(self, num_entries: int = 1):
                out, self.wcs = self.wcs[:num_entries], self.wcs[num_entries:]
                return len(out), out

            def close(self) -> None: ...

        class QPCap:
            def __init__(self, max_send_wr=1, max_recv_wr=10, max_send_sge=1, max_recv_sge=1, max_inline_data=0):
                self.max_send_wr, self.max_recv_wr = max_send_wr, max_recv_wr

        class QPInitAttr:
            def __init__(self, qp_type=4, qp_context=None, scq=None, rcq=None, srq=None, cap=None, sq_sig_all=1):
                self.qp_type, self.scq, self.rcq, self.cap = qp_type, scq, rcq, cap

        class QPAttr:
            def __init__(self, qp_state=INIT, cur_qp_state=RESET, port_num=1, path_mtu=3) -> None:
                self.qp_state, self.path_mtu = qp_state, path_mtu

        class QP:
            def __init__(self, pd, init: QPInitAttr) -> None:
                assert init.qp_type == 2  # RC
                self.init, self.state, self.posted_recvs, self.recv_posts = init, RESET, 0, 0
                self.qp_num = len(nic.qps) + 100
                nic.qps[self.qp_num] = self

            def to_init(self, attr) -> None:
                assert self.state == RESET
                self.state = INIT

            def to_rtr(self, attr) -> None:
                assert self.state == INIT
                self.state, self.path_mtu, self.dest = RTR, attr.path_mtu, attr.dest_qp_num

            def to_rts(self, attr) -> None:
                assert self.state == RTR
                self.state = RTS

            def post_recv(self, wr, bad_wr=None) -> None:
                assert self.state >= INIT and self.posted_recvs < self.init.cap.max_recv_wr
                self.posted_recvs += 1
                self.recv_posts += 1

            def post_send(self, wr, bad_wr=None) -> None:
                assert self.state == RTS and wr.opcode == 1 and wr.send_flags & 2
                # Every write is signaled: its entry is free again once its completion is polled.
                assert len(self.init.scq.wcs) < self.init.cap.max_send_wr, "send queue overrun"
                sge, peer, mr = wr.sg[0], nic.qps[self.dest], nic.mrs[wr.rkey]
                assert mr.access & 2 and mr.buf <= wr.addr and wr.addr + sge.length <= mr.buf + mr.length
                ctypes.memmove(wr.addr, sge.addr, sge.length)
                nic.sge_lengths.append(sge.length)
                nic.wire_imms.append(wr.imm_data)
                assert peer.posted_recvs > 0, "receiver not ready: no receive request posted"
                peer.posted_recvs -= 1
                wc = SimpleNamespace(wr_id=0, status=0, opcode=129, imm_data=wr.imm_data, byte_len=sge.length)
                if peer.qp_num in nic.hold:
                    nic.held.append((peer.init.rcq, wc))
                else:
                    peer.init.rcq.push(wc)
                self.init.scq.push(SimpleNamespace(wr_id=wr.wr_id, status=0, opcode=1, byte_len=sge.length))

            def close(self) -> None: ...

        class SGE:
            def __init__(self, addr: int, length: int, lkey: int) -> None:
                self.addr, self.length, self.lkey = addr, length, lkey

        class SendWR:
            def __init__(self, wr_id=0, opcode=0, num_sge=0, imm_data=0, sg=None, send_flags=2, next_wr=None):
                assert num_sge >= 1 and sg is not None, "A WR needs at least one SGE"
                self.wr_id, self.opcode, self.sg = wr_id, opcode, sg
                self.imm_data, self.send_flags = imm_data, send_flags

            def set_wr_rdma(self, rkey: int, addr: int) -> None:
                self.rkey, self.addr = rkey, addr

        class RecvWR:
            def __init__(self, wr_id=0, num_sge=0, sg=None, next_wr=None):
                assert num_sge >= 1 and sg is not None, "A WR needs at least one SGE"  # older pyverbs

        class GID:
            gid = ""

        def ns(**kw) -> SimpleNamespace:
            return SimpleNamespace(**kw)

        enums = {name: SimpleNamespace(**members) for name, members in ENUMS.items()}
        return {
            "pyverbs.device": ns(get_device_list=lambda: [ns(name=b"ib0")], Context=Context),
            "pyverbs.pyverbs_error": ns(PyverbsRDMAError=type("PyverbsRDMAError", (Exception,), {})),
            "pyverbs.libibverbs_enums": ns(**enums),
            "pyverbs.pd": ns(PD=PD), "pyverbs.mr": ns(MR=MR), "pyverbs.cq": ns(CQ=CQ),
            "pyverbs.qp": ns(QP=QP, QPCap=QPCap, QPInitAttr=QPInitAttr, QPAttr=QPAttr),
            "pyverbs.wr": ns(SGE=SGE, SendWR=SendWR, RecvWR=RecvWR),
            "pyverbs.addr": ns(GID=GID, AHAttr=lambda **kw: ns(**kw), GlobalRoute=lambda **kw: ns(**kw)),
        }


def _module(name: str, attrs: dict) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


@pytest.fixture
def nic(monkeypatch) -> FakeNic:
    """pyverbs replaced by the stand-in for this test; "ib0" has a 4096-byte active MTU,
    "roce0" 1024 (a 1500-byte Ethernet)."""
    fake = FakeNic({"ib0": 5, "roce0": 3})
    package = _module("pyverbs", {})
    monkeypatch.setitem(sys.modules, "pyverbs", package)
    for name, attrs in fake.modules().items():
        mod = _module(name, vars(attrs))
        monkeypatch.setitem(sys.modules, name, mod)
        setattr(package, name.split(".")[1], mod)
    return fake


def _pair(layout: SlabLayout) -> tuple[VerbsEndpoint, VerbsEndpoint]:
    a, b = VerbsEndpoint("ib0", layout), VerbsEndpoint("roce0", layout)
    pa, pb = a.local_params(), b.local_params()
    a.connect(pb)
    b.connect(pa)
    return a, b


def test_verbs_endpoint_mtu_write_length_immediate_and_reposts(nic):
    layout = SlabLayout(4096, 4)
    a, b = _pair(layout)
    assert (a.local_params().mtu, b.local_params().mtu) == (5, 3)  # each port's active MTU
    assert a.qp.path_mtu == b.qp.path_mtu == 3  # RTR: the smaller of the two
    assert a.qp.posted_recvs == b.qp.posted_recvs == 4  # a request per slot before RTR
    sizes = [1, 500, 4096, 7, 4000, 64, 3, 2048, 9]  # more chunks than slots: reuse after credit
    for i, n in enumerate(sizes):
        data = bytes([i]) * n
        assert a.post_slot([memoryview(data)], n) == i
        assert b.peek_slot() == data
        a.send.on_credit(b.consume_slot())
    assert nic.sge_lengths == sizes  # each write sends the bytes used, not the slot
    assert nic.wire_imms == [socket.htonl(layout.imm_of(s)) for s in range(len(sizes))]  # big-endian on the wire
    assert b.qp.recv_posts == 4 + len(sizes) and b.qp.posted_recvs == 4  # one re-post per completion
    assert a.drain_completions() == len(sizes) and a.sq.outstanding == 0


def test_verbs_endpoint_delivers_on_completion_not_placement(nic):
    a, b = _pair(SlabLayout(64, 2))
    nic.hold.add(b.qp.qp_num)
    a.post_slot([memoryview(b"placed")], 6)
    assert b.recv_mr.read(6, 0) == b"placed" and b.peek_slot() is None
    nic.release()
    assert b.peek_slot() == b"placed"


def test_verbs_endpoint_refuses_a_failed_completion(nic):
    _a, b = _pair(SlabLayout(64, 2))
    b.recv_cq.push(SimpleNamespace(wr_id=0, status=12, opcode=129, imm_data=0, byte_len=1))  # retry exceeded
    with pytest.raises(FrameError, match="status 12"):
        b.peek_slot()


async def test_rdma_connection_over_verbs_endpoints(nic):
    """The whole rdma:// connection (establish, credits, SLEEP/BELL) on VerbsEndpoint: a
    100 kB frame is 25 writes through an 8-slot slab and a 16-entry send queue."""
    layout = SlabLayout(4096, 8)
    sa, sb = socket.socketpair()
    sa.setblocking(False)
    sb.setblocking(False)
    server, client = await asyncio.gather(
        establish(sa, VerbsEndpoint("roce0", layout), TransportConfig(), is_server=True, peer="s"),
        establish(sb, VerbsEndpoint("ib0", layout), TransportConfig(), is_server=False, peer="c"))
    try:
        for i, n in enumerate((1, 5000, 100_000)):
            payload = bytes(range(256)) * (n // 256) + b"z" * (n % 256)
            send = asyncio.create_task(client.send(Frame(i, {"n": n}, [payload])))
            got = await server.recv()
            await send
            assert got.header == {"n": n} and bytes(got.tensors[0]) == payload
        assert max(nic.sge_lengths) == 4096 and min(nic.sge_lengths) < 100
        assert server._ep.qp.posted_recvs == layout.num_slots
    finally:
        await client.close()
        await server.close()


def test_verbs_constants_from_either_pyverbs_layout(monkeypatch):
    named = {n: SimpleNamespace(**members) for n, members in ENUMS.items()}
    flat = {k: v for members in ENUMS.values() for k, v in members.items()}
    monkeypatch.setitem(sys.modules, "pyverbs", _module("pyverbs", {}))
    monkeypatch.setitem(sys.modules, "pyverbs.libibverbs_enums", _module("pyverbs.libibverbs_enums", named))
    assert vars(_verbs_enums()) == flat  # rdma-core 50 and later
    monkeypatch.setitem(sys.modules, "pyverbs.libibverbs_enums", None)  # absent: ImportError
    monkeypatch.setitem(sys.modules, "pyverbs.enums", _module("pyverbs.enums", flat))
    assert vars(_verbs_enums()) == flat  # before rdma-core 50
