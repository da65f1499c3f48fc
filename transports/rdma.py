"""RDMA verbs building blocks (``pyverbs``) for the ``rdma://`` slot protocol.

Protocol: each side registers a receive slab of ``num_slots`` fixed-size slots and keeps
one receive work request posted per slot. The sender writes a chunk into the peer's next
free slot with one RDMA WRITE WITH IMMEDIATE of exactly the bytes used; the immediate
names the slot (and the sender's lap round the slab). The receiver takes a chunk only
from the completion that write produces on its receive queue (IBV_WC_RECV_RDMA_WITH_IMM:
the immediate says which slot, ``byte_len`` how many bytes), never from the slot's bytes:
the InfiniBand spec completes a message after all of its data is placed but does not
order placement within it, so a marker written last may land first. Each completion
uses up one receive request; it is re-posted as the completion is taken, so the receive
queue stays full. Credits (slots the receiver has consumed) flow back so the sender never
overwrites an unread slot. Queue pair parameters, each port's active MTU among them (the
path MTU is the smaller), are exchanged out of band over TCP.

What runs here: the parameter exchange format, MTU mapping, slot layout, immediate
encoding, sequence, credit and work-queue bookkeeping and the slot stream
(``SlotStream``) (pure Python, unit-tested, the stream over an endpoint that places bytes
and completions in host memory). ``lamina.transports.rdma_verbs.VerbsEndpoint`` drives a
real device through pyverbs.
``lamina.transports.rdma_transport`` turns it into the ``rdma://`` transport.
"""

from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass

from .errors import FrameError

_PARAMS = struct.Struct("<4sBxHII16sQIIII")  # magic ver lid qpn psn gid addr rkey slot nslots mtu
_MAGIC = b"LMNQ"
_VERSION = 2  # 2: completions carry the chunk (immediate + byte length), no trailer

# enum ibv_mtu (infiniband/verbs.h) -> bytes; the values grow with the size.
MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
IMM_SLOT_BITS = 16  # the immediate's low half names the slot: num_slots <= 1 << 16


def mtu_bytes(mtu: int) -> int:
    """Bytes of an ``ibv_mtu`` value (a port's ``active_mtu``, a QP's ``path_mtu``)."""
    if mtu not in MTU_BYTES:
        raise ValueError(f"{mtu} is no ibv_mtu value (1..5 = 256..4096 bytes)")
    return MTU_BYTES[mtu]


def path_mtu(local_active: int, peer_active: int) -> int:
    """The RTR transition's ``path_mtu``: the smaller of the two ports' active MTUs. A port
    carries no more than its active MTU (on RoCE it follows the Ethernet MTU: 1024 under a
    1500-byte network), so a larger path MTU loses packets."""
    mtu_bytes(local_active)
    mtu_bytes(peer_active)
    return min(local_active, peer_active)


def encode_imm(slot: int, lap: int) -> int:
    """Immediate of a write into ``slot`` on the sender's ``lap``-th pass round the slab:
    lap mod 2**16 in the high half, slot in the low half. Host order: the verbs calls
    convert (``imm_data`` travels big-endian)."""
    if not 0 <= slot < 1 << IMM_SLOT_BITS or lap < 0:
        raise ValueError(f"no immediate for slot {slot}, lap {lap}")
    return (lap & 0xFFFF) << IMM_SLOT_BITS | slot


def decode_imm(imm: int) -> tuple[int, int]:
    """(slot, lap mod 2**16) of an immediate."""
    if not 0 <= imm < 1 << 32:
        raise FrameError(f"immediate {imm} is not a 32-bit value")
    return imm & (1 << IMM_SLOT_BITS) - 1, imm >> IMM_SLOT_BITS


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
    mtu: int  # the sender's port's active MTU, an ibv_mtu value

    def __post_init__(self) -> None:
        if len(self.gid) != 16:
            raise ValueError("gid must be 16 bytes")
        if not 0 <= self.lid < 1 << 16 or not 0 < self.qpn < 1 << 24 or not 0 <= self.psn < 1 << 24:
            raise ValueError(f"bad queue pair parameters lid={self.lid} qpn={self.qpn} psn={self.psn}")
        mtu_bytes(self.mtu)  # validates
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
    """A receive slab of ``num_slots`` slots of ``slot_bytes``; a chunk fills a slot's head."""

    slot_bytes: int
    num_slots: int

    def __post_init__(self) -> None:
        if self.slot_bytes < 64 or self.slot_bytes % 64:
            raise ValueError(f"slot_bytes must be a positive multiple of 64, got {self.slot_bytes}")
        if not 1 <= self.num_slots <= 1 << IMM_SLOT_BITS:
            raise ValueError(f"num_slots must be in 1..65536, got {self.num_slots}")

    @property
    def slab_bytes(self) -> int:
        return self.slot_bytes * self.num_slots

    def slot_of(self, seq: int) -> int:
        return seq % self.num_slots

    def offset_of(self, seq: int) -> int:
        return self.slot_of(seq) * self.slot_bytes

    def imm_of(self, seq: int) -> int:
        """The immediate that goes with chunk ``seq``."""
        return encode_imm(self.slot_of(seq), seq // self.num_slots)


@dataclass(frozen=True)
class SlotWrite:
    """One RDMA WRITE WITH IMMEDIATE, everything its SGE and work request need."""

    seq: int
    offset: int  # of the slot, in the sender's staging slab and the peer's slab alike
    length: int  # the SGE's length: the chunk's bytes, not the slot's
    imm: int  # host order


class SendWindow:
    """Sender side: next sequence number and credits (slots free at the receiver)."""

    def __init__(self, layout: SlabLayout) -> None:
        self.layout = layout
        self.next_seq = 0
        self.acked = 0  # chunks the receiver reported consumed

    @property
    def num_free(self) -> int:
        return self.layout.num_slots - (self.next_seq - self.acked)

    def can_send(self) -> bool:
        return self.num_free > 0

    def reserve(self, nbytes: int) -> SlotWrite:
        """The write of the next chunk, ``nbytes`` long."""
        if not 0 < nbytes <= self.layout.slot_bytes:
            raise FrameError(f"a chunk of {nbytes} bytes does not fit a slot of {self.layout.slot_bytes}")
        if not self.can_send():
            raise RuntimeError("no free slot at the receiver: wait for credits")
        seq = self.next_seq
        self.next_seq += 1
        return SlotWrite(seq, self.layout.offset_of(seq), nbytes, self.layout.imm_of(seq))

    def on_credit(self, consumed_total: int) -> None:
        """The receiver reports how many chunks it has consumed in all (monotonic)."""
        if consumed_total < self.acked or consumed_total > self.next_seq:
            raise FrameError(f"bad credit {consumed_total} (acked {self.acked}, sent {self.next_seq})")
        self.acked = consumed_total


class RecvWindow:
    """Receiver side: chunks whose completion has been taken, in order, and the next to
    consume. A chunk exists here only once its completion does, whatever the slab holds."""

    def __init__(self, layout: SlabLayout) -> None:
        self.layout = layout
        self.next_seq = 0  # next chunk to consume
        self.arrived = 0  # completions taken in all
        self._lengths: deque[int] = deque()  # byte_len of arrived, unconsumed chunks

    def on_completion(self, imm: int, byte_len: int) -> int:
        """Take the completion of the next write; returns its seq. RC completes writes in
        order, so anything but the next slot and lap is a broken peer."""
        seq = self.arrived
        if imm != self.layout.imm_of(seq):
            slot, lap = decode_imm(imm)
            want_slot, want_lap = decode_imm(self.layout.imm_of(seq))
            raise FrameError(f"write into slot {slot} (lap {lap}), expected slot {want_slot} (lap {want_lap})")
        if not 0 < byte_len <= self.layout.slot_bytes:
            raise FrameError(f"write of {byte_len} bytes into a slot of {self.layout.slot_bytes}")
        if seq - self.next_seq >= self.layout.num_slots:
            raise FrameError(f"peer wrote chunk {seq} over unconsumed chunk {self.next_seq}: no credit for it")
        self._lengths.append(byte_len)
        self.arrived += 1
        return seq

    def peek(self) -> tuple[int, int] | None:
        """(slab offset, length) of the next chunk if its completion has arrived, else None."""
        if not self._lengths:
            return None
        return self.layout.offset_of(self.next_seq), self._lengths[0]

    def consume(self) -> int:
        """Release the next chunk; returns chunks consumed in all (the credit to report)."""
        if not self._lengths:
            raise RuntimeError("no completed chunk to consume")
        self._lengths.popleft()
        self.next_seq += 1
        return self.next_seq


class WorkQueue:
    """Work requests outstanding on one verbs queue (posted, not yet completed), at most
    ``depth``. The receive queue is topped up to ``depth`` after every batch of taken
    completions (one re-post per completion); the send queue waits for ``room``."""

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"a work queue needs a depth of at least 1, got {depth}")
        self.depth = depth
        self.outstanding = 0

    @property
    def room(self) -> int:
        return self.depth - self.outstanding

    def on_posted(self, n: int) -> None:
        if not 0 <= n <= self.room:
            raise RuntimeError(f"posting {n} work requests into a queue with room for {self.room}")
        self.outstanding += n

    def on_completed(self, n: int) -> None:
        if not 0 <= n <= self.outstanding:
            raise FrameError(f"{n} completions for {self.outstanding} outstanding work requests")
        self.outstanding -= n


def chunk_capacity(layout: SlabLayout) -> int:
    """Stream bytes one slot carries: all of it (the length travels with the completion)."""
    return layout.slot_bytes


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
    """The slot protocol of the ``rdma://`` byte stream, over any endpoint that writes into
    the peer's slab and reports receive completions.

    A frame's bytes travel in chunks, one per slot and write. The endpoint supplies the
    only operations that touch a device:
    ``_post_write(write, data)``: stage ``data`` (``write.length`` bytes) at ``write.offset``
    of its staging slab and post one RDMA WRITE WITH IMMEDIATE of those bytes to the same
    offset of the peer's slab, immediate ``write.imm``;
    ``_poll_recv()``: the receive completions that arrived since the last call, oldest
    first, as (immediate, byte length) pairs (an error completion raises);
    ``_post_recv(n)``: post ``n`` receive work requests;
    ``_slab_read(nbytes, offset)``: bytes of its own receive slab.
    The logic here is tested with an endpoint that does this in host memory; the verbs
    one is ``VerbsEndpoint``.
    """

    def __init__(self, layout: SlabLayout) -> None:
        self.layout = layout
        self.send = SendWindow(layout)
        self.recv = RecvWindow(layout)
        # One receive request per slot is enough: the sender writes only into slots it
        # has credit for, and a completion not yet taken holds its slot, so the writes
        # that can still arrive never outnumber the posted requests.
        self.rq = WorkQueue(layout.num_slots)

    def _post_write(self, write: SlotWrite, data: bytes) -> None:
        raise NotImplementedError  # the endpoint's: see the class docstring

    def _poll_recv(self) -> list[tuple[int, int]]:
        raise NotImplementedError  # the endpoint's: see the class docstring

    def _post_recv(self, n: int) -> None:
        raise NotImplementedError  # the endpoint's: see the class docstring

    def _slab_read(self, nbytes: int, offset: int) -> bytes:
        raise NotImplementedError  # the endpoint's: see the class docstring

    def fill_receive_queue(self) -> None:
        """Post receive requests up to the queue's depth (before the peer may write, and
        after taking completions)."""
        n = self.rq.room
        if n:
            self._post_recv(n)
            self.rq.on_posted(n)

    def post_slot(self, chunks: list[memoryview], nbytes: int) -> int:
        """Write ``chunks`` (``nbytes`` in all, at most ``chunk_capacity``) into the peer's
        next slot; returns its seq. Raises RuntimeError without a credit."""
        write = self.send.reserve(nbytes)
        self._post_write(write, b"".join(chunks))
        return write.seq

    def take_completions(self) -> int:
        """Take the receive completions that arrived and re-post as many receive requests;
        returns how many."""
        arrived = self._poll_recv()
        self.rq.on_completed(len(arrived))
        for imm, byte_len in arrived:
            self.recv.on_completion(imm, byte_len)
        self.fill_receive_queue()
        return len(arrived)

    def peek_slot(self) -> bytes | None:
        """The next chunk once its write's completion is taken, else None."""
        if self.recv.peek() is None:
            self.take_completions()
        head = self.recv.peek()
        if head is None:
            return None
        offset, nbytes = head
        return self._slab_read(nbytes, offset)

    def consume_slot(self) -> int:
        """Release the slot read by ``peek_slot``; returns chunks consumed in all."""
        return self.recv.consume()
