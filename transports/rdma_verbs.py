"""``VerbsEndpoint``: the ``rdma://`` slot protocol (``lamina.transports.rdma``) on a real
RDMA device through pyverbs.

It has never run on hardware: these machines have no RDMA device and no pyverbs. Its
calls follow rdma-core's pyverbs API, and the tests drive it over a stand-in with those
classes and signatures (tests/transports/test_rdma_verbs.py); the conformance suite runs
it where pyverbs and a device exist.
"""

from __future__ import annotations

import socket
from types import SimpleNamespace

from .errors import FrameError, TransportUnavailable
from .rdma import QpParams, SlabLayout, SlotStream, SlotWrite, WorkQueue, device_availability, path_mtu


def _verbs_enums() -> SimpleNamespace:
    """The verbs constants used here. rdma-core 50 and later has them in named enums of
    ``pyverbs.libibverbs_enums`` (59 and later only there: Cython 3.1 stopped copying enum
    members to module level); older releases have them flat in ``pyverbs.enums``."""
    names = {"ibv_access_flags": ("IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_WRITE"),
             "ibv_qp_type": ("IBV_QPT_RC",), "ibv_qp_state": ("IBV_QPS_RESET", "IBV_QPS_INIT"),
             "ibv_wr_opcode": ("IBV_WR_RDMA_WRITE_WITH_IMM",), "ibv_send_flags": ("IBV_SEND_SIGNALED",),
             "ibv_wc_status": ("IBV_WC_SUCCESS",), "ibv_wc_opcode": ("IBV_WC_RECV_RDMA_WITH_IMM",)}
    try:
        import pyverbs.libibverbs_enums as named

        return SimpleNamespace(**{n: int(getattr(getattr(named, enum), n))
                                  for enum, members in names.items() for n in members})
    except (ImportError, AttributeError):
        import pyverbs.enums as flat

        return SimpleNamespace(**{n: int(getattr(flat, n)) for members in names.values() for n in members})


class VerbsEndpoint(SlotStream):
    """One RC queue pair with a registered receive slab, a send staging slab and one
    completion queue per direction.

    Usage: ``a = VerbsEndpoint(dev, layout)``, exchange ``a.local_params()`` with the peer
    (out of band, e.g. over a TCP connection), ``a.connect(peer_params)``, then
    ``post_slot`` / ``peek_slot`` / ``consume_slot``; ``drain_completions`` reaps sends.
    """

    def __init__(self, device: str, layout: SlabLayout, *, port: int = 1, gid_index: int = 0) -> None:
        reason = device_availability()
        if reason is not None:
            raise TransportUnavailable(reason)
        from pyverbs.cq import CQ
        from pyverbs.device import Context
        from pyverbs.mr import MR
        from pyverbs.pd import PD
        from pyverbs.qp import QP, QPCap, QPInitAttr

        super().__init__(layout)
        e = self._e = _verbs_enums()
        self.port = port
        self.gid_index = gid_index
        self.ctx = Context(name=device)
        self.active_mtu = int(self.ctx.query_port(port).active_mtu)
        self.pd = PD(self.ctx)
        self.recv_mr = MR(self.pd, layout.slab_bytes, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)
        # One staging slot per receive slot: slot s is rewritten only after the peer's
        # credit shows chunk s consumed, i.e. after the NIC has long finished reading it.
        self.send_mr = MR(self.pd, layout.slab_bytes, e.IBV_ACCESS_LOCAL_WRITE)
        self.sq = WorkQueue(layout.num_slots + 8)  # every write is signaled: one entry each
        self.send_cq = CQ(self.ctx, self.sq.depth, None, None, 0)  # pyverbs: all positional
        self.recv_cq = CQ(self.ctx, self.rq.depth, None, None, 0)
        cap = QPCap(max_send_wr=self.sq.depth, max_recv_wr=self.rq.depth, max_send_sge=1, max_recv_sge=1)
        self.qp = QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.send_cq, rcq=self.recv_cq, cap=cap))
        self.peer: QpParams | None = None

    @property
    def connected_peer(self) -> QpParams:
        """The peer given to ``connect``."""
        if self.peer is None:
            raise RuntimeError("this RDMA endpoint is not connected yet: call connect() first")
        return self.peer

    def local_params(self) -> QpParams:
        port_attr = self.ctx.query_port(self.port)
        gid = self.ctx.query_gid(self.port, self.gid_index)  # str(gid): 'xxxx:...:xxxx'
        return QpParams(lid=port_attr.lid, qpn=self.qp.qp_num, psn=0, gid=bytes.fromhex(str(gid).replace(":", "")),
                        slab_addr=self.recv_mr.buf, rkey=self.recv_mr.rkey,
                        slot_bytes=self.layout.slot_bytes, num_slots=self.layout.num_slots,
                        mtu=self.active_mtu)

    def connect(self, peer: QpParams) -> None:
        """Fill the receive queue and bring the queue pair to RTS towards ``peer``."""
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr
        from pyverbs.wr import SGE, RecvWR

        e = self._e
        if (peer.slot_bytes, peer.num_slots) != (self.layout.slot_bytes, self.layout.num_slots):
            raise FrameError("peer slab layout differs from ours")
        self.peer = peer
        attr = QPAttr(qp_state=e.IBV_QPS_INIT, cur_qp_state=e.IBV_QPS_RESET)
        attr.pkey_index = 0
        attr.port_num = self.port
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        self.qp.to_init(attr)
        # A WRITE WITH IMMEDIATE places nothing through the receive request, but older
        # pyverbs refuses a RecvWR without an SGE: one over slot 0, never written by it.
        self._recv_wr = RecvWR(wr_id=0, num_sge=1, sg=[SGE(self.recv_mr.buf, self.layout.slot_bytes,
                                                           self.recv_mr.lkey)])
        self.fill_receive_queue()  # in INIT, before the peer can reach us
        gid = GID()
        gid.gid = ":".join(peer.gid.hex()[i:i + 4] for i in range(0, 32, 4))
        gr = GlobalRoute(dgid=gid, sgid_index=self.gid_index)
        attr.ah_attr = AHAttr(port_num=self.port, is_global=1, gr=gr, dlid=peer.lid)
        attr.path_mtu = path_mtu(self.active_mtu, peer.mtu)
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

    def post_write_imm(self, laddr: int, lkey: int, length: int, raddr: int, rkey: int,
                       imm: int, wr_id: int = 0) -> None:
        """Post one signaled RDMA WRITE WITH IMMEDIATE of ``length`` bytes of registered
        local memory, ``imm`` in host order (also used by the FHBN host proxy, which gets
        these fields from GPU-enqueued requests). Waits for a send queue entry."""
        from pyverbs.wr import SGE, SendWR

        e = self._e
        while not self.sq.room:  # a completion or an error arrives within the QP's retry timeout
            self.drain_completions()
        wr = SendWR(wr_id=wr_id, opcode=e.IBV_WR_RDMA_WRITE_WITH_IMM, num_sge=1,
                    sg=[SGE(laddr, length, lkey)], send_flags=e.IBV_SEND_SIGNALED)
        wr.imm_data = socket.htonl(imm)
        wr.set_wr_rdma(rkey=rkey, addr=raddr)
        self.qp.post_send(wr)
        self.sq.on_posted(1)

    def _post_write(self, write: SlotWrite, data: bytes) -> None:
        self.send_mr.write(data, write.length, write.offset)
        peer = self.connected_peer
        self.post_write_imm(self.send_mr.buf + write.offset, self.send_mr.lkey, write.length,
                            peer.slab_addr + write.offset, peer.rkey, write.imm, write.seq)

    def _poll_recv(self) -> list[tuple[int, int]]:
        _n, wcs = self.recv_cq.poll(num_entries=self.rq.depth)
        out = []
        for wc in wcs:
            self._check(wc)
            if wc.opcode != self._e.IBV_WC_RECV_RDMA_WITH_IMM:
                raise FrameError(f"receive completion of opcode {wc.opcode}: the peer only writes with immediate")
            out.append((socket.ntohl(wc.imm_data), wc.byte_len))
        return out

    def _post_recv(self, n: int) -> None:
        for _ in range(n):  # ibv_post_recv copies the request: one object serves every post
            self.qp.post_recv(self._recv_wr)

    def _slab_read(self, nbytes: int, offset: int) -> bytes:
        return self.recv_mr.read(nbytes, offset)

    def _check(self, wc) -> None:
        if wc.status != self._e.IBV_WC_SUCCESS:
            raise FrameError(f"RDMA work completion {wc.wr_id} failed with status {wc.status}")

    def drain_completions(self) -> int:
        """Reap send completions, freeing send queue entries; returns how many."""
        n, wcs = self.send_cq.poll(num_entries=self.sq.depth)
        for wc in wcs:
            self._check(wc)
        self.sq.on_completed(n)
        return n

    def close(self) -> None:
        for obj in (self.qp, self.send_cq, self.recv_cq, self.send_mr, self.recv_mr, self.pd, self.ctx):
            obj.close()
