"""RDMA verbs transport (``rdma://DEVICE/PORT/HOST:TCPPORT``) on ``VerbsEndpoint``.

A connection is two things:
- the data path: an RC queue pair per side; a frame's bytes are cut into slot-sized chunks
  and each chunk is written into the peer's pre-registered receive slab with one RDMA
  WRITE WITH IMMEDIATE of the chunk's bytes. The receiver takes a chunk when it takes
  that write's receive completion (the immediate names the slot, the completion's byte
  length is the chunk's), re-posting one receive request per completion; no receive copy
  through the kernel.
- an out-of-band TCP control socket: the handshake (wire version, cluster token), the
  exchange of ``QpParams``, a ready byte each way once the queue pair can take writes,
  then 9-byte control messages: CREDIT(chunks consumed in all, receiver -> sender, so no
  unread slot is overwritten), SLEEP(seq) (the receiver found no completion for chunk
  ``seq`` after a bounded spin and is about to block) and BELL (the sender has written at
  least that chunk). Its EOF reports a vanished peer at once.

Wake-up protocol (no lost wake-up, no timer): the receiver sends SLEEP(s), polls its
completion queue again, then blocks on the control socket; the sender, on SLEEP(s), rings
BELL at once if it has already posted chunk s, else right after posting it. A BELL that
outruns the write's completion only causes a re-check and another SLEEP, answered at once.

The endpoint is duck-typed (``layout``, ``send``/``recv`` windows, ``post_slot``,
``peek_slot``, ``consume_slot``, ``drain_completions``, ``close``) so the connection logic
is tested here over an endpoint that places bytes and completions in host memory
(tests/transports); ``VerbsEndpoint`` is the real one and needs pyverbs and an RDMA device.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from collections.abc import Callable

from .base import Handler, SocketListener, StreamConnection, Transport, with_timeout
from .config import TransportConfig
from .errors import FrameError, PeerClosed, TransportError, TransportUnavailable
from .handshake import client_handshake, server_handshake
from .rdma import QpParams, SlabLayout, chunk_capacity, device_availability, parse_rdma_address, split_chunks

log = logging.getLogger(__name__)

CONTROL = struct.Struct("<BQ")
CREDIT, SLEEP, BELL = 1, 2, 3
READY = b"\x01"  # each side's last handshake byte: its queue pair can take writes
# Poll for a completion this long before blocking. Short: on a cluster the receiver usually
# has a core to itself and could spin longer; on shared cores spinning steals the peer's.
SPIN_NS = 20_000
DEFAULT_LAYOUT = SlabLayout(slot_bytes=64 * 1024, num_slots=64)  # 4 MiB slab per side


class ControlChannel:
    """The connection's TCP control socket after the handshake: a reader callback that
    stays registered parses control messages; ``wait()`` returns after any message or EOF.

    Owned by one RdmaConnection; all methods run on its event loop.
    """

    def __init__(self, sock: socket.socket, peer: str, sent: Callable[[], int]) -> None:
        self._sock = sock
        self.sent = sent  # slots this side has written in all (decides SLEEP -> BELL)
        self._peer = peer
        self._loop = asyncio.get_running_loop()
        self._buf = bytearray()
        self._waiters: list[asyncio.Future] = []
        self.eof = False
        self.error: TransportError | None = None
        self.peer_credit = 0  # chunks the peer has consumed in all
        self.peer_sleeping_at: int | None = None  # the peer waits for our slot of this seq
        self.bells = 0
        self._loop.add_reader(sock.fileno(), self._on_readable)
        self._reading = True

    def _on_readable(self) -> None:
        try:
            data = self._sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.error = PeerClosed(f"control connection to {self._peer} lost: {exc}")
            data = b""
        if not data:
            self.eof = True
            self._stop_reading()
        else:
            self._buf += data
            size = CONTROL.size
            usable = len(self._buf) - len(self._buf) % size
            for off in range(0, usable, size):
                kind, value = CONTROL.unpack_from(self._buf, off)
                if kind == CREDIT:
                    self.peer_credit = max(self.peer_credit, value)
                elif kind == SLEEP:
                    if self.sent() > value:  # already written: ring now, whatever our task does
                        self.peer_sleeping_at = None
                        self._bell()
                    else:
                        self.peer_sleeping_at = value
                elif kind == BELL:
                    self.bells += 1
                else:
                    self.error = FrameError(f"bad control message {kind} from {self._peer}")
                    self._stop_reading()
                    break
            del self._buf[:usable]
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _bell(self) -> None:
        try:
            self.send(BELL)
        except PeerClosed as exc:
            self.error = self.error or exc

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._sock.fileno())

    def send(self, kind: int, value: int = 0) -> None:
        """Queue one control message; they are tiny, so the kernel buffer has room unless
        the peer stopped reading its control socket altogether (then it is gone)."""
        try:
            self._sock.send(CONTROL.pack(kind, value), socket.MSG_NOSIGNAL)
        except BlockingIOError:
            raise PeerClosed(f"control connection to {self._peer} is stalled") from None
        except OSError as exc:
            raise PeerClosed(f"control connection to {self._peer} lost: {exc}") from None

    async def wait(self) -> None:
        if self.eof or self.error is not None:
            return
        fut = self._loop.create_future()
        self._waiters.append(fut)
        try:
            await fut
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)

    def close(self, reason: str) -> None:
        self._stop_reading()
        for fut in self._waiters:
            if not fut.done():
                fut.set_exception(PeerClosed(reason))
        self._waiters.clear()
        self._sock.close()


class RdmaConnection(StreamConnection):
    def __init__(self, endpoint, control: ControlChannel, config: TransportConfig, peer: str) -> None:
        super().__init__(config)
        self._ep = endpoint
        self._ctl = control
        self._peer = peer
        self._capacity = chunk_capacity(endpoint.layout)
        self._credit_every = max(1, endpoint.layout.num_slots // 2)
        self._reported = 0  # credit last sent to the peer
        self._chunk: bytes | memoryview = b""  # the slot being read (a copy, or a view valid
        self._chunk_pos = 0                      # until consume_slot)

    @property
    def peer(self) -> str:
        return self._peer

    def _check_peer(self) -> None:
        if self._closed:
            raise PeerClosed(f"connection to {self._peer} is closed")
        if self._ctl.error is not None:
            raise self._ctl.error
        if self._ctl.eof:
            raise PeerClosed(f"peer {self._peer} closed the connection")

    # ------------------------------------------------------------------ sending
    async def _write(self, views: list[memoryview]) -> None:
        ep, ctl = self._ep, self._ctl
        for chunks, nbytes in split_chunks(views, self._capacity):
            while True:
                self._check_peer()
                ep.send.on_credit(max(ctl.peer_credit, ep.send.acked))
                if ep.send.can_send():
                    break
                await ctl.wait()  # the receiver is a full slab behind: backpressure
            seq = ep.post_slot(chunks, nbytes)
            sleeping = ctl.peer_sleeping_at
            if sleeping is not None and seq >= sleeping:
                ctl.peer_sleeping_at = None
                ctl.send(BELL)
        ep.drain_completions()
        sleeping = ctl.peer_sleeping_at
        if sleeping is not None and ep.send.next_seq > sleeping:
            ctl.peer_sleeping_at = None
            ctl.send(BELL)

    # ------------------------------------------------------------------ receiving
    def _release_chunk(self) -> None:
        """The current chunk is copied out: free its slot, report credit in batches."""
        self._chunk, self._chunk_pos = b"", 0
        consumed = self._ep.consume_slot()
        if consumed - self._reported >= self._credit_every:
            self._reported = consumed
            self._ctl.send(CREDIT, consumed)

    async def _next_chunk(self, first: bool) -> None:
        ep, ctl = self._ep, self._ctl
        chunk = ep.peek_slot()
        if chunk is None:
            deadline = time.perf_counter_ns() + SPIN_NS
            while (chunk := ep.peek_slot()) is None and time.perf_counter_ns() < deadline:
                pass
        while chunk is None:
            if self._reported < ep.recv.next_seq:
                self._reported = ep.recv.next_seq  # a blocked sender may need these credits
                ctl.send(CREDIT, self._reported)
            ctl.send(SLEEP, ep.recv.next_seq)
            if (chunk := ep.peek_slot()) is not None:
                break
            try:
                self._check_peer()
            except PeerClosed:
                if first:
                    raise
                raise PeerClosed(f"peer {self._peer} closed the connection in the middle of a frame") from None
            await ctl.wait()
            chunk = ep.peek_slot()
        self._chunk, self._chunk_pos = chunk, 0

    async def _read_exact(self, view: memoryview, *, first: bool = False) -> None:
        need = view.nbytes
        pos = 0
        while pos < need:
            if not self._chunk:
                await self._next_chunk(first and pos == 0)
            start = self._chunk_pos
            take = min(len(self._chunk) - start, need - pos)
            view[pos:pos + take] = memoryview(self._chunk)[start:start + take]
            pos += take
            self._chunk_pos = start + take
            if self._chunk_pos == len(self._chunk):
                self._release_chunk()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._ctl.close(f"connection to {self._peer} was closed")
        try:
            self._ep.close()
        except Exception as exc:  # the device may already be in error
            log.debug("closing RDMA endpoint to %s: %s", self._peer, exc, exc_info=True)


async def _recv_exact(loop, sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(sock, n - len(buf))
        if not chunk:
            raise PeerClosed("peer closed the connection during the handshake")
        buf += chunk
    return bytes(buf)


async def establish(sock: socket.socket, endpoint, config: TransportConfig, *, is_server: bool,
                    peer: str) -> RdmaConnection:
    """Handshake on ``sock``, exchange queue pair parameters, connect ``endpoint``."""
    loop = asyncio.get_running_loop()
    send = lambda b: loop.sock_sendall(sock, b)  # noqa: E731
    recv = lambda n: _recv_exact(loop, sock, n)  # noqa: E731
    if is_server:
        await server_handshake(send, recv, config.auth_token)
    else:
        await client_handshake(send, recv, config.auth_token)
    await send(endpoint.local_params().pack())
    remote = QpParams.unpack(await recv(QpParams.SIZE))
    if (remote.slot_bytes, remote.num_slots) != (endpoint.layout.slot_bytes, endpoint.layout.num_slots):
        raise FrameError(f"peer slab layout {remote.slot_bytes}x{remote.num_slots} differs from ours")
    endpoint.connect(remote)
    # Our receive requests are posted and the queue pair is ready; the peer's first write
    # must wait for the same of its side, or it would meet a queue pair not yet in RTR
    # (dropped packets, retries, and after seven of them a failed connection).
    await send(READY)
    if await recv(len(READY)) != READY:
        raise FrameError(f"peer {peer} sent no ready byte after connecting its queue pair")
    control = ControlChannel(sock, peer, lambda: endpoint.send.next_seq)
    return RdmaConnection(endpoint, control, config, peer)


class RdmaListener(SocketListener):
    def __init__(self, sock: socket.socket, device: str, port: int, config: TransportConfig,
                 handler: Handler | None) -> None:
        self._device, self._port = device, port
        host, tcp_port = sock.getsockname()[:2]
        super().__init__(sock, f"rdma://{device}/{port}/{host}:{tcp_port}", config, handler)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, addr = await loop.sock_accept(self._sock)
            except OSError as exc:
                log.warning("accept on %s failed: %s", self._address, exc)
                await asyncio.sleep(0.1)
                continue
            self._spawn(self._setup(sock, f"{addr[0]}:{addr[1]}"))

    async def _setup(self, sock: socket.socket, peer: str) -> None:
        from .rdma_verbs import VerbsEndpoint

        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        endpoint = None
        try:
            endpoint = VerbsEndpoint(self._device, DEFAULT_LAYOUT, port=self._port)
            conn = await with_timeout(establish(sock, endpoint, self.config, is_server=True, peer=peer),
                                      self.config.handshake_timeout, f"handshake with {peer}")
        except (TransportError, OSError, ValueError) as exc:
            log.warning("refused connection on %s: %s", self._address, exc)
            sock.close()
            if endpoint is not None:
                endpoint.close()
            return
        except BaseException:
            sock.close()
            if endpoint is not None:
                endpoint.close()
            raise
        self._deliver(conn)


class RdmaTransport(Transport):
    scheme = "rdma"

    @classmethod
    def availability(cls) -> str | None:
        return device_availability()

    def _check(self) -> None:
        reason = self.availability()
        if reason is not None:  # get_transport checks too; direct users get the same error
            raise TransportUnavailable(f"transport {self.scheme!r} is unavailable here: {reason}")

    async def listen(self, address: str, handler: Handler | None, config: TransportConfig) -> RdmaListener:
        device, port, host, tcp_port = parse_rdma_address(address)
        self._check()
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, tcp_port))
            sock.listen(1024)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise TransportError(f"cannot listen on {address}: {exc}") from exc
        return RdmaListener(sock, device, port, config, handler)

    async def connect(self, address: str, config: TransportConfig) -> RdmaConnection:
        from .rdma_verbs import VerbsEndpoint

        device, port, host, tcp_port = parse_rdma_address(address)
        self._check()
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        endpoint = None
        try:
            await with_timeout(loop.sock_connect(sock, (host, tcp_port)), config.connect_timeout,
                               f"connect to {address}")
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            endpoint = VerbsEndpoint(device, DEFAULT_LAYOUT, port=port)
            return await with_timeout(establish(sock, endpoint, config, is_server=False, peer=f"{host}:{tcp_port}"),
                                      config.handshake_timeout, f"handshake with {address}")
        except OSError as exc:
            sock.close()
            if endpoint is not None:
                endpoint.close()
            raise PeerClosed(f"cannot connect to {address}: {exc}") from exc
        except BaseException:
            sock.close()
            if endpoint is not None:
                endpoint.close()
            raise
