"""RDMA verbs building blocks (``pyverbs``) for the FHBN receive protocol.

Protocol: each side registers a receive slab of ``num_slots`` fixed-size slots. The
sender writes a frame into the peer's next free slot with RDMA WRITE WITH IMMEDIATE
(immediate = slot index) and the last 8 bytes of the slot, the trailer, carry the frame's
sequence number (+1, so a zeroed slab never looks written). RC queue pairs place a
write's bytes in order, so a receiver that polls the trailer in memory (the CPU here,
a CUDA kernel in FHBN) sees the whole payload once the sequence number appears: no
completion-queue polling on the receive path. Credits (slots the receiver has consumed)
flow back so the sender never overwrites an unread slot. Queue-pair parameters are
exchanged out of band over TCP.

What runs here: the parameter exchange format, slot layout, sequence and credit
bookkeeping and the slot stream (``SlotStream``) (pure Python, unit-tested, the latter
over an endpoint that places bytes in host memory). ``VerbsEndpoint`` drives a real
device through pyverbs and is tested only where an RDMA device exists (these machines
have none).
``lamina.transports.rdma_transport`` turns it into the ``rdma://`` transport.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .errors import FrameError, TransportUnavailable

TRAILER_BYTES = 8
CHUNK_HEADER = struct.Struct("<I")  # bytes of stream data in a slot (slot stream)
_PARAMS = struct.Struct("<4sBxHII16sQIIII")  # magic ver lid qpn psn gid addr rkey slot nslots mtu
_MAGIC = b"LMNQ"
_VERSION = 1


@dataclass(frozen=True)
class QpParams:
    """What one side tells the other to connect an RC queue pair and write to its slab."""

    lid: int
    qpn: int
    psn: int
    gid: bytes  # 16 bytes (RoCE needs it; zeros on IB without GRH)
    slab_addr: int
    rkey: int
    slot_bytes: int
    num_slots: int
    mtu: int = 4  # IBV_MTU_4096

    def __post_init__(self) -> None:
        if len(self.gid) != 16:
            raise ValueError("gid must be 16 bytes")
        if not 0 <= self.lid < 1 << 16 or not 0 < self.qpn < 1 << 24 or not 0 <= self.psn < 1 << 24:
            raise ValueError(f"bad queue pair parameters lid={self.lid} qpn={self.qpn} psn={self.psn}")
        SlabLayout(self.slot_bytes, self.num_slots)  # validates

    def pack(self) -> bytes:
        return _PARAMS.pack(_MAGIC, _VERSION, self.lid, self.qpn, self.psn, self.gid, self.slab_addr,
                            self.rkey, self.slot_bytes, self.num_slots, self.mtu)

    @classmethod
    def unpack(cls, data: bytes) -> QpParams:
        if len(data) != _PARAMS.size:
            raise FrameError(f"queue pair parameters must be {_PARAMS.size} bytes, got {len(data)}")
        magic, version, lid, qpn, psn, gid, addr, rkey, slot, nslots, mtu = _PARAMS.unpack(data)
        if magic != _MAGIC or version != _VERSION:
            raise FrameError(f"bad queue pair parameter message (magic {magic!r}, version {version})")
        try:
            return cls(lid, qpn, psn, gid, addr, rkey, slot, nslots, mtu)
        except ValueError as exc:
            raise FrameError(str(exc)) from exc

    SIZE = _PARAMS.size


@dataclass(frozen=True)
class SlabLayout:
    """A receive slab of ``num_slots`` slots of ``slot_bytes``; payload then 8-byte trailer."""

    slot_bytes: int
    num_slots: int

    def __post_init__(self) -> None:
        if self.slot_bytes < 64 or self.slot_bytes % 64:
            raise ValueError(f"slot_bytes must be a positive multiple of 64, got {self.slot_bytes}")
        if not 1 <= self.num_slots <= 1 << 16:
            raise ValueError(f"num_slots must be in 1..65536, got {self.num_slots}")

    @property
    def slab_bytes(self) -> int:
        return self.slot_bytes * self.num_slots

    @property
    def max_payload(self) -> int:
        return self.slot_bytes - TRAILER_BYTES

    def slot_of(self, seq: int) -> int:
        return seq % self.num_slots

    def payload_offset(self, seq: int) -> int:
        return self.slot_of(seq) * self.slot_bytes

    def trailer_offset(self, seq: int) -> int:
        return self.payload_offset(seq) + self.max_payload

    @staticmethod
    def trailer_value(seq: int) -> int:
        """What the sender writes after the payload of frame ``seq`` (never 0)."""
        return (seq + 1) & 0xFFFF_FFFF_FFFF_FFFF or 1


class SendWindow:
    """Sender side: next sequence number and credits (slots free at the receiver)."""

    def __init__(self, layout: SlabLayout) -> None:
        self.layout = layout
        self.next_seq = 0
        self.acked = 0  # frames the receiver reported consumed

    @property
    def num_free(self) -> int:
        return self.layout.num_slots - (self.next_seq - self.acked)

    def can_send(self) -> bool:
        return self.num_free > 0

    def reserve(self, nbytes: int) -> tuple[int, int, int]:
        """(seq, payload offset, trailer offset) for a frame of ``nbytes``."""
        if nbytes > self.layout.max_payload:
            raise FrameError(f"frame of {nbytes} bytes exceeds the slot payload {self.layout.max_payload}")
        if not self.can_send():
            raise RuntimeError("no free slot at the receiver: wait for credits")
        seq = self.next_seq
        self.next_seq += 1
        return seq, self.layout.payload_offset(seq), self.layout.trailer_offset(seq)

    def on_credit(self, consumed_total: int) -> None:
        """The receiver reports how many frames it has consumed in all (monotonic)."""
        if consumed_total < self.acked or consumed_total > self.next_seq:
            raise FrameError(f"bad credit {consumed_total} (acked {self.acked}, sent {self.next_seq})")
        self.acked = consumed_total


class RecvWindow:
    """Receiver side: which slot and trailer value the next frame has."""

    def __init__(self, layout: SlabLayout) -> None:
        self.layout = layout
        self.next_seq = 0

    def expected(self) -> tuple[int, int]:
        """(trailer offset, trailer value) that mark the next frame as complete."""
        return self.layout.trailer_offset(self.next_seq), self.layout.trailer_value(self.next_seq)

    def is_ready(self, trailer: int) -> bool:
        return trailer == self.layout.trailer_value(self.next_seq)

    def consume(self) -> tuple[int, int]:
        """Mark the next frame consumed; returns (its seq, credit to report = frames consumed)."""
        seq = self.next_seq
        self.next_seq += 1
        return seq, self.next_seq

    def check_immediate(self, imm: int) -> None:
        """The immediate of a completion names the slot; it must be the expected one."""
        if imm != self.layout.slot_of(self.next_seq):
            raise FrameError(f"write into slot {imm}, expected slot {self.layout.slot_of(self.next_seq)}")


def chunk_capacity(layout: SlabLayout) -> int:
    """Stream bytes one slot carries: the payload area less the chunk length."""
    return layout.max_payload - CHUNK_HEADER.size


def split_chunks(views: list[memoryview], capacity: int) -> list[tuple[list[memoryview], int]]:
    """Cut a frame's views into slot-sized chunks (no copy): [(views, nbytes), ...]."""
    out: list[tuple[list[memoryview], int]] = []
    cur: list[memoryview] = []
    room = capacity
    for v in views:
        while v.nbytes:
            take = min(room, v.nbytes)
            cur.append(v[:take])
            v = v[take:]
            room -= take
            if room == 0:
                out.append((cur, capacity))
                cur, room = [], capacity
    if cur:
        out.append((cur, capacity - room))
    return out


def parse_rdma_address(address: str) -> tuple[str, int, str, int]:
    """``rdma://DEVICE/PORT/HOST:TCPPORT`` -> (device, port, host, tcp port).

    DEVICE is the verbs device name (``ibv_devices``), PORT its port number (1-based);
    HOST:TCPPORT is the out-of-band TCP endpoint that exchanges queue pair parameters,
    carries credits and doorbells, and reports a vanished peer.
    """
    scheme, sep, rest = address.partition("://")
    parts = rest.split("/") if sep else []
    if len(parts) != 3 or not parts[0] or not parts[1].isdigit() or int(parts[1]) < 1:
        raise ValueError(f"{scheme or 'rdma'} address must look like {scheme or 'rdma'}://mlx5_0/1/host:port, "
                         f"got {address!r}")
    host, colon, port = parts[2].rpartition(":")
    if not colon or not port.isdigit():
        raise ValueError(f"address {address!r} needs host:port after the device and port")
    return parts[0], int(parts[1]), host.strip("[]") or "127.0.0.1", int(port)


def device_availability() -> str | None:
    """``None`` when pyverbs and an RDMA device are present, else the reason."""
    try:
        from pyverbs.device import get_device_list
        from pyverbs.pyverbs_error import PyverbsRDMAError
    except ImportError:
        return "pyverbs is not installed (rdma-core's python3-pyverbs)"
    try:
        devices = get_device_list()
    except PyverbsRDMAError as exc:  # raised, not an empty list, when there is none
        return f"no RDMA device: {exc}"
    if not devices:
        return "no RDMA device"
    return None


class SlotStream:
    """The slot protocol of the ``rdma://`` byte stream, over any slab-placing endpoint.

    A frame's bytes travel in chunks, one per slot: u32 chunk length, the chunk, and the
    trailer (sequence number + 1) at the slot's end. The endpoint supplies
    ``_place(offset, data, trailer_offset, trailer, seq)`` (stage the bytes and write them
    into the peer's slab at ``offset``, the trailer landing last) and
    ``_slab_read(nbytes, offset)`` (bytes of its own receive slab); the pure logic here is
    tested with an endpoint that places bytes in host memory, the verbs one is
    ``VerbsEndpoint``. Attributes used: ``layout``, ``send`` (SendWindow), ``recv``
    (RecvWindow).
    """

    layout: SlabLayout
    send: SendWindow
    recv: RecvWindow

    def _place(self, offset: int, data: bytes, trailer_offset: int, trailer: bytes, seq: int) -> None:
        raise NotImplementedError  # the endpoint's: see the class docstring

    def _slab_read(self, nbytes: int, offset: int) -> bytes:
        raise NotImplementedError  # the endpoint's: see the class docstring

    def post_slot(self, chunks: list[memoryview], nbytes: int) -> int:
        """Write ``chunks`` (``nbytes`` in all, at most ``chunk_capacity``) into the peer's
        next slot; returns its seq. Raises RuntimeError without a credit."""
        seq, offset, trailer = self.send.reserve(CHUNK_HEADER.size + nbytes)
        data = b"".join([CHUNK_HEADER.pack(nbytes), *chunks])
        self._place(offset, data, trailer, struct.pack("<Q", self.layout.trailer_value(seq)), seq)
        return seq

    def peek_slot(self) -> bytes | None:
        """The chunk of the next slot once its trailer shows it complete, else None."""
        off, value = self.recv.expected()
        (trailer,) = struct.unpack("<Q", self._slab_read(TRAILER_BYTES, off))
        if trailer != value:
            return None
        base = self.layout.payload_offset(self.recv.next_seq)
        (n,) = CHUNK_HEADER.unpack(self._slab_read(CHUNK_HEADER.size, base))
        if n > chunk_capacity(self.layout):
            raise FrameError(f"slot announces {n} bytes, more than a slot holds")
        return self._slab_read(n, base + CHUNK_HEADER.size)

    def consume_slot(self) -> int:
        """Release the slot read by ``peek_slot``; returns frames consumed in all."""
        return self.recv.consume()[1]


class VerbsEndpoint(SlotStream):
    """One RC queue pair with a registered receive slab and a send staging buffer.

    Usage: ``a = VerbsEndpoint(dev, layout)``, exchange ``a.local_params()`` with the peer
    (out of band, e.g. over a TCP connection), ``a.connect(peer_params)``, then
    ``a.write_frame(data)`` / ``a.poll_frame()``.
    """

    def __init__(self, device: str, layout: SlabLayout, *, port: int = 1, gid_index: int = 0,
                 cq_depth: int = 256) -> None:
        reason = device_availability()
        if reason is not None:
            raise TransportUnavailable(reason)
        import pyverbs.enums as e
        from pyverbs.cq import CQ
        from pyverbs.device import Context
        from pyverbs.mr import MR
        from pyverbs.pd import PD
        from pyverbs.qp import QP, QPCap, QPInitAttr

        self._e = e
        self.layout = layout
        self.port = port
        self.gid_index = gid_index
        self.ctx = Context(name=device)
        self.pd = PD(self.ctx)
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        self.recv_mr = MR(self.pd, layout.slab_bytes, access)
        # One staging slot per receive slot: slot s is rewritten only after the peer's
        # credit shows frame s consumed, i.e. after the NIC has long finished reading it.
        self.send_mr = MR(self.pd, layout.slab_bytes, e.IBV_ACCESS_LOCAL_WRITE)
        cq_depth = max(cq_depth, 2 * layout.num_slots + 16)  # send and receive completions
        self.cq = CQ(self.ctx, cq_depth, None, None, 0)  # pyverbs: every argument is positional
        cap = QPCap(max_send_wr=layout.num_slots + 8, max_recv_wr=layout.num_slots,
                    max_send_sge=1, max_recv_sge=1)
        self.qp = QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap))
        self.send = SendWindow(layout)
        self.recv = RecvWindow(layout)
        self.peer: QpParams | None = None

    @property
    def connected_peer(self) -> QpParams:
        """The peer given to ``connect``."""
        if self.peer is None:
            raise RuntimeError("this RDMA endpoint is not connected yet: call connect() first")
        return self.peer

    def local_params(self) -> QpParams:
        port_attr = self.ctx.query_port(self.port)
        gid = self.ctx.query_gid(self.port, self.gid_index)
        return QpParams(lid=port_attr.lid, qpn=self.qp.qp_num, psn=0, gid=bytes(gid.gid_bytes)
                        if hasattr(gid, "gid_bytes") else bytes.fromhex(str(gid).replace(":", "")),
                        slab_addr=self.recv_mr.buf, rkey=self.recv_mr.rkey,
                        slot_bytes=self.layout.slot_bytes, num_slots=self.layout.num_slots)

    def connect(self, peer: QpParams) -> None:
        """Bring the queue pair to RTS towards ``peer`` and post receives for immediates."""
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr
        from pyverbs.wr import RecvWR

        e = self._e
        if peer.slot_bytes != self.layout.slot_bytes:
            raise FrameError("peer slab layout differs from ours")
        self.peer = peer
        attr = QPAttr(qp_state=e.IBV_QPS_INIT, cur_qp_state=e.IBV_QPS_RESET)
        attr.pkey_index = 0
        attr.port_num = self.port
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        self.qp.to_init(attr)
        gid = GID()
        gid.gid = ":".join(peer.gid.hex()[i:i + 4] for i in range(0, 32, 4))
        gr = GlobalRoute(dgid=gid, sgid_index=self.gid_index)
        attr.ah_attr = AHAttr(port_num=self.port, is_global=1, gr=gr, dlid=peer.lid)
        attr.path_mtu = peer.mtu
        attr.dest_qp_num = peer.qpn
        attr.rq_psn = peer.psn
        attr.max_dest_rd_atomic = 1
        attr.min_rnr_timer = 12
        self.qp.to_rtr(attr)
        attr.sq_psn = 0
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        attr.max_rd_atomic = 1
        self.qp.to_rts(attr)
        for i in range(self.layout.num_slots):  # each WRITE WITH IMM consumes one
            self.qp.post_recv(RecvWR(wr_id=i, num_sge=0))

    def write_frame(self, data: bytes | memoryview) -> int:
        """Copy ``data`` to the staging buffer and write it (payload + trailer) into the
        peer's next slot with one RDMA WRITE WITH IMMEDIATE; returns its seq."""
        from pyverbs.wr import SGE, SendWR

        e = self._e
        seq, offset, _trailer = self.send.reserve(len(data))
        self.send_mr.write(bytes(data), len(data), 0)
        # The trailer sits at the slot's end: write the whole slot so it lands last.
        self.send_mr.write(struct.pack("<Q", self.layout.trailer_value(seq)), TRAILER_BYTES,
                           self.layout.max_payload)
        sge = SGE(self.send_mr.buf, self.layout.slot_bytes, self.send_mr.lkey)
        wr = SendWR(wr_id=seq, opcode=e.IBV_WR_RDMA_WRITE_WITH_IMM, num_sge=1, sg=[sge],
                    send_flags=e.IBV_SEND_SIGNALED)
        wr.imm_data = self.layout.slot_of(seq)
        peer = self.connected_peer
        wr.set_wr_rdma(rkey=peer.rkey, addr=peer.slab_addr + offset)
        self.qp.post_send(wr)
        return seq

    def post_write_imm(self, laddr: int, lkey: int, length: int, raddr: int, rkey: int,
                       imm: int, wr_id: int = 0) -> None:
        """Post one signaled RDMA WRITE WITH IMMEDIATE of registered local memory (used by
        the FHBN host proxy, which gets these fields from GPU-enqueued requests)."""
        from pyverbs.wr import SGE, SendWR

        e = self._e
        wr = SendWR(wr_id=wr_id, opcode=e.IBV_WR_RDMA_WRITE_WITH_IMM, num_sge=1,
                    sg=[SGE(laddr, length, lkey)], send_flags=e.IBV_SEND_SIGNALED)
        wr.imm_data = imm
        wr.set_wr_rdma(rkey=rkey, addr=raddr)
        self.qp.post_send(wr)

    def _place(self, offset: int, data: bytes, trailer_offset: int, trailer: bytes, seq: int) -> None:
        # Staging slot = receive slot index, so one WRITE covers the whole slot and the
        # trailer at its end is placed last (RC ordering).
        self.send_mr.write(data, len(data), offset)
        self.send_mr.write(trailer, TRAILER_BYTES, trailer_offset)
        peer = self.connected_peer
        self.post_write_imm(self.send_mr.buf + offset, self.send_mr.lkey, self.layout.slot_bytes,
                            peer.slab_addr + offset, peer.rkey, self.layout.slot_of(seq), seq)

    def _slab_read(self, nbytes: int, offset: int) -> bytes:
        return self.recv_mr.read(nbytes, offset)

    def poll_frame(self, nbytes: int) -> bytes | None:
        """The next frame's first ``nbytes`` once its trailer shows it complete (memory
        polling, no CQ), else None."""
        off, value = self.recv.expected()
        (trailer,) = struct.unpack("<Q", self.recv_mr.read(TRAILER_BYTES, off))
        if trailer != value:
            return None
        data = self.recv_mr.read(nbytes, self.layout.payload_offset(self.recv.next_seq))
        self.recv.consume()
        return data

    def drain_completions(self) -> int:
        """Reap send completions and immediates (re-posting receives); returns how many."""
        from pyverbs.wr import RecvWR

        e = self._e
        n, wcs = self.cq.poll(num_entries=64)
        for wc in wcs:
            if wc.status != e.IBV_WC_SUCCESS:
                raise FrameError(f"RDMA work completion failed with status {wc.status}")
            if wc.opcode == e.IBV_WC_RECV_RDMA_WITH_IMM:
                self.qp.post_recv(RecvWR(wr_id=wc.wr_id, num_sge=0))
        return n

    def close(self) -> None:
        for obj in (self.qp, self.cq, self.send_mr, self.recv_mr, self.pd, self.ctx):
            obj.close()
