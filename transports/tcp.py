"""TCP transport (``tcp://host:port``): the always-available default.

Uses the non-blocking socket directly from the event loop rather than asyncio streams:
writes are one synchronous ``sendmsg`` of [preamble+header, payload views...]
(scatter/gather, payloads never copied in user space), awaiting writability only when
the kernel buffer is full. Reads are push-driven by one reader callback that stays
registered (see ``TcpConnection``): small frames land in a scratch buffer and preamble
and header are parsed in place, so a small frame costs one ``recv`` and one task
wake-up; large payloads are received straight into the destination tensor, with the
socket's low-water mark (SO_RCVLOWAT) raised meanwhile so that the receiver wakes for
megabytes rather than for each few segments (on two cores, waking per segment takes
the CPU the sender needs: bench/transport_pingpong.py, docs/transports.md). The kernel's
socket buffers and the bounded scratch buffer are the only queues: a slow receiver makes
``send`` wait (backpressure, no unbounded buffer).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time

from .base import (
    Handler,
    SocketListener,
    StreamConnection,
    Transport,
    advance,
    client_handshake_or_close,
    parse_host_port,
    with_timeout,
)
from .config import TransportConfig
from .errors import PeerClosed, TransportError
from .frame import PREAMBLE_SIZE, Frame, byte_view, decode_preamble, parse_frame
from .handshake import server_handshake

log = logging.getLogger(__name__)

_SCRATCH = 256 * 1024
_SPIN_READ_BUDGETS = 20  # a payload's receive spins at most this many busy-poll budgets
_DIRECT = 64 * 1024  # payload remainders at least this large are received in place
_IOV_MAX = 512
# Bytes the kernel gathers before it wakes a large payload's receiver (at most what is
# left of it, so that the last part wakes it too). 1 MiB: every 16 MiB round trip of the
# benchmark at or above the raw socket's, against 75-93% with the default mark of 1.
_LARGE_LOWAT = 1 << 20
_PEER_GONE = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


def _configure(sock: socket.socket, config: TransportConfig) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if config.socket_buffer_bytes is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, config.socket_buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, config.socket_buffer_bytes)
    if config.tcp_keepalive_s is not None:
        k = config.tcp_keepalive_s
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, k)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, k // 3))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class TcpConnection(StreamConnection):
    """Reads are push-driven: one reader callback stays registered for the connection's
    life and moves bytes from the socket into a scratch buffer (or, while a large payload
    is being received, straight into its destination), waking the receiving task only
    when what it waits for is complete. Registering and removing a reader per wait (what
    ``loop.sock_recv_into`` does) costs two epoll updates and a handle per frame.

    Invariants: ``_rview[_rstart:_rend]`` holds received, unconsumed stream bytes; while
    ``_dest`` is set the scratch buffer is empty and the callback fills ``_dest`` only;
    the reader is paused (removed) only while the scratch buffer is full, and the consumer
    resumes it when it makes room, so the socket buffer stays the backpressure bound.
    """

    def __init__(self, sock: socket.socket, config: TransportConfig, peer: str) -> None:
        super().__init__(config)
        self._sock = sock
        self._fd = sock.fileno()
        self._peer = peer
        self._loop = asyncio.get_running_loop()
        self._rbuf = bytearray(_SCRATCH)
        self._rview = memoryview(self._rbuf)
        self._rstart = 0
        self._rend = 0
        self._want = 0  # bytes the waiter needs buffered from _rstart
        self._dest: memoryview | None = None  # remaining part of a direct payload read
        self._waiter: asyncio.Future | None = None
        self._write_waiter: asyncio.Future | None = None
        self._error: TransportError | None = None  # EOF or socket error, seen by the callback
        self._eof = False
        self._lowat = 1  # the socket's SO_RCVLOWAT; 0 where it cannot be set
        self._loop.add_reader(self._fd, self._on_readable)
        self._reading = True

    @property
    def peer(self) -> str:
        return self._peer

    # ------------------------------------------------------------------ reader callback
    def _on_readable(self) -> None:
        if self._dest is not None:
            self._read_direct()
        elif self._pull() > 0 and self._rend - self._rstart >= self._want:
            self._wake_reader()

    def _pull(self) -> int:
        """One non-blocking read into the scratch buffer (the callback's, and the
        receiver's while it polls): bytes read; 0 when there is nothing to read; -1 when
        reading stops here (EOF or an error, recorded for the receiver; or a full buffer,
        reading paused until the consumer drains it)."""
        if self._eof or self._error is not None:
            return -1
        end = self._rend
        if end == _SCRATCH:
            if self._rstart == 0:
                self._pause()
                return -1
            self._compact()
            end = self._rend
        n = self._recv_direct(self._rview[end:])
        if n > 0:
            self._rend = end + n
        return n

    def _read_direct(self) -> None:
        """Receive into the large payload's destination, while the kernel has more: one
        wake-up per burst, not per skb."""
        dest = self._dest
        assert dest is not None  # called only while a payload's destination is set
        while True:
            n = self._recv_direct(dest)
            if n <= 0:
                break
            if n == dest.nbytes:
                self._dest = None
                self._set_lowat(1)  # the next frame may be a few bytes
                self._wake_reader()
                return
            dest = dest[n:]
        self._dest = dest
        if dest.nbytes < self._lowat:
            self._set_lowat(dest.nbytes)

    def _recv_direct(self, dest: memoryview) -> int:
        """One non-blocking read into ``dest`` (not empty: the scratch buffer's free end,
        or a large payload's destination): bytes read; 0 when there is nothing to read;
        -1 when reading stops here (EOF or an error, recorded for the receiver)."""
        try:
            n = self._sock.recv_into(dest)
        except (BlockingIOError, InterruptedError):
            return 0
        except _PEER_GONE as exc:
            self._fail(PeerClosed(f"connection to {self._peer} lost: {exc}"))
            return -1
        except OSError as exc:
            self._fail(TransportError(f"recv from {self._peer} failed: {exc}"))
            return -1
        if n == 0:
            self._eof = True
            self._fail(None)
            return -1
        return n

    def _set_lowat(self, n: int) -> None:
        """Wake the reader callback only once `n` bytes are buffered (Linux also signals
        at once when that many already are). Left at 1 where the option is refused."""
        if self._lowat in (0, n):
            return
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, n)
            self._lowat = n
        except OSError:
            self._lowat = 0

    def _wake_reader(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, error: TransportError | None) -> None:
        """EOF (``None``) or an error: stop reading and wake the receiver to report it."""
        if error is not None and self._error is None:
            self._error = error
        self._pause()
        self._wake_reader()

    def _pause(self) -> None:
        if self._reading:
            self._reading = False
            if not self._closed:
                self._loop.remove_reader(self._fd)

    def _resume(self) -> None:
        if not self._reading and not self._eof and self._error is None and not self._closed:
            self._reading = True
            self._loop.add_reader(self._fd, self._on_readable)

    def _compact(self) -> None:
        start, end = self._rstart, self._rend
        if start:
            self._rview[:end - start] = self._rview[start:end]
            self._rstart, self._rend = 0, end - start

    # ------------------------------------------------------------------ consumer side
    def _check_readable(self, first: bool, got: int, need: int) -> None:
        if self._closed:
            raise PeerClosed(f"connection to {self._peer} is closed")
        if self._error is not None:
            raise self._error
        if self._eof:
            if first and got == 0:
                raise PeerClosed(f"peer {self._peer} closed the connection")
            raise PeerClosed(f"peer {self._peer} closed the connection in the middle of a frame "
                             f"(truncated: {got} of {need} bytes of a read)")

    async def _wait_readable(self) -> None:
        fut = self._loop.create_future()
        self._waiter = fut
        try:
            await fut
        finally:
            self._waiter = None

    # ------------------------------------------------------------------ fast path
    def _recv_now(self, out) -> Frame | None:
        # A frame that fits the scratch buffer is parsed in place once all of it is
        # buffered; meanwhile the receiver polls the socket within its busy-poll budget.
        poll = self._poll
        native = self._native
        deadline = 0.0
        while True:
            start = self._rstart
            avail = self._rend - start
            if avail >= PREAMBLE_SIZE:
                frame = None
                if native is not None:
                    r = native.parse(self._rview, start, avail, self.config.max_frame_bytes, out)
                    if type(r) is tuple:
                        frame, size = r
                    else:
                        size = r
                else:
                    pre = decode_preamble(self._rview, self.config.max_frame_bytes, start)
                    size = PREAMBLE_SIZE + pre.header_len + pre.payload_len
                    if avail >= size:
                        frame = parse_frame(pre, self._rview[start + PREAMBLE_SIZE:start + size],
                                            out, self._outs)
                if frame is not None:
                    self._rstart = start + size
                    if self._rstart == self._rend:
                        self._rstart = self._rend = 0
                    if not self._reading:
                        self._resume()
                    if deadline:
                        poll.hit()
                    return frame
                if size > _SCRATCH:
                    if deadline:  # it began while this wait spun: the peer answered in time
                        poll.hit()
                    return None  # streamed by the waiting path
                if start + size > _SCRATCH:
                    self._compact()
            n = self._pull()
            if n > 0:
                continue
            if n < 0:
                return None
            deadline = poll.keep_spinning(deadline)
            if not deadline:
                return None

    async def _fill(self, n: int, *, first: bool = False) -> None:
        """Wait until ``n`` (<= the scratch size) bytes are buffered from ``_rstart``."""
        if self._rstart + n > _SCRATCH:
            self._compact()
        while self._rend - self._rstart < n:
            self._check_readable(first, self._rend - self._rstart, n)
            self._want = n
            self._resume()
            await self._wait_readable()

    async def _read_small(self, n: int, *, first: bool = False) -> bytes | bytearray | memoryview:
        if n > _SCRATCH:
            return await super()._read_small(n, first=first)
        if self._rend - self._rstart < n:
            await self._fill(n, first=first)
        start = self._rstart
        self._rstart = start + n
        if self._rstart == self._rend:
            self._rstart = self._rend = 0  # empty: later reads start at the front
        if not self._reading:
            self._resume()
        return self._rview[start:start + n]  # valid until the next read: parsed in place

    async def _read_exact(self, view: memoryview, *, first: bool = False) -> None:
        need = view.nbytes
        pos = min(self._rend - self._rstart, need)
        if pos:
            view[:pos] = self._rview[self._rstart:self._rstart + pos]
            self._rstart += pos
            if self._rstart == self._rend:
                self._rstart = self._rend = 0
            if not self._reading:
                self._resume()
        if pos == need:
            return
        remaining = need - pos
        if remaining < _DIRECT:
            await self._fill(remaining, first=first and pos == 0)
            start = self._rstart
            view[pos:] = self._rview[start:start + remaining]
            self._rstart = start + remaining
            if self._rstart == self._rend:
                self._rstart = self._rend = 0
            return
        # Large: the callback receives straight into the destination (no copy).
        dest = view[pos:]
        try:  # the bytes may already be in the socket buffer: no loop round trip then
            n = self._sock.recv_into(dest)
        except (BlockingIOError, InterruptedError):
            n = -1
        except _PEER_GONE as exc:
            raise PeerClosed(f"connection to {self._peer} lost: {exc}") from None
        except OSError as exc:
            if self._closed or exc.errno == errno.EBADF:
                raise PeerClosed(f"connection to {self._peer} is closed") from None
            raise TransportError(f"recv from {self._peer} failed: {exc}") from exc
        if n == 0:
            self._eof = True
            self._check_readable(first, pos, need)
        if n > 0:
            pos += n
            if pos == need:
                return
            dest = dest[n:]
        dest = self._spin_direct(dest)
        if not dest.nbytes:
            return
        self._dest = dest
        self._set_lowat(min(dest.nbytes, _LARGE_LOWAT))
        try:
            while self._dest is not None:
                self._check_readable(first, need - self._dest.nbytes, need)
                self._resume()
                await self._wait_readable()
        finally:
            self._dest = None
            self._set_lowat(1)

    def _spin_direct(self, dest: memoryview) -> memoryview:
        """Receive the rest of a large payload straight into ``dest`` while its bytes keep
        coming within the busy-poll budget of each other; what is left to receive.

        The peer is sending this very frame, so its next bytes are microseconds away:
        waiting for them in the event loop (a wake-up per low-water mark) cost a 256 KiB
        round trip about half its time. As the shared-memory ring's waits inside a frame do,
        this spins whatever the policy says of frame starts, and not with no budget (an
        oversubscribed host). It hands over to the event loop after ``_SPIN_READ_BUDGETS``
        budgets in all (1 ms by default): a payload still arriving then comes slowly
        enough (a slow link) that a wake-up per low-water mark costs little, and the loop
        has other connections to serve. An error or EOF is recorded as the reader
        callback records it (`_recv_direct`), for the waiting path to raise."""
        budget = self._poll.budget
        if budget <= 0:
            return dest
        clock = time.perf_counter
        now = clock()
        stop = now + _SPIN_READ_BUDGETS * budget
        deadline = now + budget
        while dest.nbytes and clock() < deadline:
            n = self._recv_direct(dest)
            if n < 0:
                break
            if n:
                dest = dest[n:]
                deadline = min(clock() + budget, stop)
        return dest


    # ------------------------------------------------------------------ sending
    def _send_native(self, native, frame: Frame, user: bytes):
        cfg = self.config
        # One sendmsg of [preamble+header, payloads...] built natively (tensor memory by
        # pointer): the whole frame normally leaves here.
        left = native.send(self._sock.fileno(), frame.kind, user, frame.tensors,
                           cfg.checksum_payloads, cfg.max_frame_bytes)
        if left == 0:
            return None
        return self._send_encoded(frame, user, left)  # left None: not for the native path

    def _write_now(self, bufs: list) -> list[memoryview] | None:
        # One sendmsg of [preamble+header, payloads...]: the whole frame normally leaves here.
        if len(bufs) <= _IOV_MAX:
            try:
                sent = self._sock.sendmsg(bufs, (), socket.MSG_NOSIGNAL)
            except OSError:  # would block, or an error that the waiting path reports
                sent = 0
            if sent == len(bufs[0]) + sum(b.nbytes for b in bufs[1:]):
                return None
            return advance([byte_view(b) for b in bufs], sent)
        return [byte_view(b) for b in bufs]

    async def _write(self, views: list[memoryview]) -> None:
        # Try the send synchronously; await writability only when the kernel buffer is full.
        sock = self._sock
        while views:
            if self._closed:
                raise PeerClosed(f"connection to {self._peer} is closed")
            try:
                sent = sock.sendmsg(views[:_IOV_MAX], (), socket.MSG_NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                await self._wait_writable()
                continue
            except _PEER_GONE as exc:
                raise PeerClosed(f"connection to {self._peer} lost: {exc}") from None
            except OSError as exc:
                if self._closed or exc.errno == errno.EBADF:
                    raise PeerClosed(f"connection to {self._peer} is closed") from None
                raise TransportError(f"send to {self._peer} failed: {exc}") from exc
            views = advance(views, sent)

    async def _wait_writable(self) -> None:
        fut = self._loop.create_future()
        self._write_waiter = fut
        self._loop.add_writer(self._fd, _wake, fut)
        try:
            await fut
        finally:
            self._write_waiter = None
            if not self._closed:
                self._loop.remove_writer(self._fd)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._fd)
        if self._write_waiter is not None:
            self._loop.remove_writer(self._fd)
        for fut in (self._waiter, self._write_waiter):
            if fut is not None and not fut.done():
                fut.set_exception(PeerClosed(f"connection to {self._peer} was closed"))
        self._sock.close()

    # Handshake helpers (raw bytes before framing starts).
    async def _send_raw(self, data: bytes) -> None:
        await self._write([memoryview(data)])

    async def _recv_raw(self, n: int) -> bytes:
        buf = bytearray(n)
        await self._read_exact(memoryview(buf), first=True)
        return bytes(buf)


class TcpListener(SocketListener):
    def __init__(self, sock: socket.socket, config: TransportConfig, handler: Handler | None) -> None:
        host, port = sock.getsockname()[:2]
        address = f"tcp://{host}:{port}" if ":" not in host else f"tcp://[{host}]:{port}"
        super().__init__(sock, address, config, handler)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, addr = await loop.sock_accept(self._sock)
            except OSError as exc:  # e.g. EMFILE: keep serving the peers we have
                log.warning("accept on %s failed: %s", self._address, exc)
                await asyncio.sleep(0.1)
                continue
            self._spawn(self._setup(sock, f"{addr[0]}:{addr[1]}"))

    async def _setup(self, sock: socket.socket, peer: str) -> None:
        try:
            _configure(sock, self.config)
            conn = TcpConnection(sock, self.config, peer)
        except OSError as exc:
            log.warning("setting up connection from %s failed: %s", peer, exc)
            sock.close()
            return
        try:
            await with_timeout(server_handshake(conn._send_raw, conn._recv_raw, self.config.auth_token),
                               self.config.handshake_timeout, f"handshake with {peer}")
        except (TransportError, OSError) as exc:
            log.warning("refused connection from %s: %s", peer, exc)
            await conn.close()
            return
        except BaseException:
            await conn.close()
            raise
        self._deliver(conn)


class TcpTransport(Transport):
    scheme = "tcp"

    async def listen(self, address: str, handler: Handler | None, config: TransportConfig) -> TcpListener:
        host, port = parse_host_port(address)
        infos = await asyncio.get_running_loop().getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, sockaddr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if config.socket_buffer_bytes is not None:  # inherited by accepted sockets
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, config.socket_buffer_bytes)
            sock.bind(sockaddr)
            sock.listen(1024)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise TransportError(f"cannot listen on {address}: {exc}") from exc
        return TcpListener(sock, config, handler)

    async def connect(self, address: str, config: TransportConfig) -> TcpConnection:
        host, port = parse_host_port(address)
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, sockaddr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            _configure(sock, config)
            await with_timeout(loop.sock_connect(sock, sockaddr), config.connect_timeout,
                               f"connect to {address}")
        except OSError as exc:
            sock.close()
            raise PeerClosed(f"cannot connect to {address}: {exc}") from exc
        except BaseException:
            sock.close()
            raise
        conn = TcpConnection(sock, config, f"{host}:{port}")
        await client_handshake_or_close(conn, config, address)
        return conn
