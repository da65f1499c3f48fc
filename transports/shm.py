"""Shared-memory transport for peers on one host (``shm://name``).

Each connection maps one memfd holding two single-producer/single-consumer byte rings
(one per direction); frames are copied into the ring by the sender and out of it,
straight into the destination tensor, by the receiver. Frames larger than 64 KiB are
streamed through it in pieces of at most 256 KiB, so both copies overlap (a 4 MiB frame's
round trip took about two thirds of its time in 4 MiB pieces, docs/transports.md), and
the receiver spins for the next piece as for a frame (below), since the peer is copying
it.

The connection's unix-domain socket (abstract namespace, derived from ``name``) carries
the handshake, passes the memfd, and then serves as the doorbell. An abstract socket has
no file, hence no file permissions: any process of the host's network namespace can
connect, so each side reads its peer's uid (SO_PEERCRED) and refuses a peer that runs as
another user, before the handshake. The token handshake then applies as on TCP.

Doorbell: a side that finds its ring empty (or full) sets its waiting flag, re-checks,
and sleeps on the socket; the other side writes one byte when it sees the flag. The socket's reader stays registered
for the connection's life and reports a vanished peer (EOF) at once.

A receiver first polls the ring's head counter for ``busy_poll_us`` without setting its
flag, so a quick peer's frame is taken with no system call on either side. Spinning
helps only while the peer has a core of its own (it takes the CPU a peer on the same
core needs), so the adaptive policy in transports/polling.py stops it on a connection
whose peer answers slowly (a wait that sees the start of a streamed frame counts as
answered). Frames up to 64 KiB are written whole and parsed straight out of the ring.

Ring layout: 256-byte control block (head @0, tail @64,
reader_waiting @128, writer_waiting @192, u64 each; head/tail count bytes ever
written/read) followed by the data area.

Memory ordering: the flag protocol relies on x86-like ordering of Python's aligned 8-byte
stores; a store-load reordering could lose one wake-up, so every sleep is bounded
(one safety timer per connection fires every ``_SAFETY_S`` while anyone sleeps) and
re-checks the ring, which turns such a loss into a short delay, never a hang.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import socket
import struct
import time

from .base import Handler, SocketListener, StreamConnection, Transport, split_address, with_timeout
from .config import TransportConfig
from .errors import AuthError, FrameError, PeerClosed, TransportError
from .frame import PREAMBLE_SIZE, Frame, byte_view, decode_preamble, parse_frame
from .handshake import client_handshake, server_handshake

log = logging.getLogger(__name__)

_CTRL = 256
_HEAD, _TAIL, _READER_WAITING, _WRITER_WAITING = 0, 8, 16, 24  # u64 indices
_SAFETY_S = 0.02
_CHUNKS = 4  # a large frame is streamed through the ring in pieces of ring/_CHUNKS,
_CHUNK_MAX = 256 * 1024  # at most this: the reader copies one out while the writer copies the next
# A read or write inside a frame (copying, or waiting for the peer) lets the event loop
# run its other tasks at least this often: a frame of hundreds of megabytes would
# otherwise hold it for its whole trip, every other connection of the process waiting.
_TURN_S = 0.001
_COALESCE = 4096  # frames up to this size are copied into the ring in one piece
_WHOLE = 64 * 1024  # frames up to this size (and the ring's) are parsed in place
_MAX_RING = 1 << 30
_SETUP = struct.Struct("<Q")
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def socket_address(name: str) -> str:
    if not name or "/" in name or len(name) > 90:
        raise ValueError(f"shm address needs a name without '/' of at most 90 characters, got {name!r}")
    return f"\0lamina-shm/{name}"


class _Ring:
    """One direction: control words and the data area inside the shared mapping."""

    def __init__(self, base: memoryview, offset: int, size: int) -> None:
        self.ctrl = base[offset:offset + _CTRL].cast("Q")
        self.data = base[offset + _CTRL:offset + _CTRL + size]
        self.size = size

    def release(self) -> None:
        self.ctrl.release()
        self.data.release()


class ShmConnection(StreamConnection):
    def __init__(self, sock: socket.socket, mm: mmap.mmap, ring_bytes: int, is_client: bool,
                 config: TransportConfig, peer: str) -> None:
        super().__init__(config)
        self._sock = sock
        self._fd = sock.fileno()
        self._mm = mm
        self._base = memoryview(mm)
        first = _Ring(self._base, 0, ring_bytes)
        second = _Ring(self._base, _CTRL + ring_bytes, ring_bytes)
        # The client writes the first ring and reads the second.
        self._out, self._in = (first, second) if is_client else (second, first)
        self._chunk = max(min(ring_bytes // _CHUNKS, _CHUNK_MAX), 4096)
        self._peer = peer
        self._loop = asyncio.get_running_loop()
        self._waiters: list[asyncio.Future] = []
        self._safety: asyncio.TimerHandle | None = None
        self._eof = False
        self._whole = min(_WHOLE, ring_bytes)
        self._loop.add_reader(self._fd, self._on_bell)
        self._watching = True

    @property
    def peer(self) -> str:
        return self._peer

    # ------------------------------------------------------------------ doorbell
    def _ring_bell(self) -> None:
        try:
            self._sock.send(b"\x01")
        except BlockingIOError:
            pass  # unread doorbell bytes are already waiting: the peer will wake
        except OSError:
            self._eof = True  # peer gone; the next wait reports it

    def _on_bell(self) -> None:
        try:
            data = self._sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._eof = True
            self._unwatch()  # level-triggered EOF would otherwise fire forever
        self._wake_all()

    def _wake_all(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _on_safety(self) -> None:
        self._safety = None
        self._wake_all()  # each sleeper re-checks its ring and sleeps again if need be

    def _unwatch(self) -> None:
        if self._watching:
            self._loop.remove_reader(self._fd)
            self._watching = False

    async def _sleep(self) -> None:
        """Wait for a doorbell byte, the peer's EOF, or the safety tick.

        The doorbell socket's reader stays registered for the connection's life (adding
        and removing it per wait costs two epoll updates), and one safety timer per
        connection, armed while someone sleeps, replaces a timer per sleep.
        """
        fut = self._loop.create_future()
        self._waiters.append(fut)
        if self._safety is None:
            self._safety = self._loop.call_later(_SAFETY_S, self._on_safety)
        try:
            await fut
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)

    def _gone(self, first: bool, got: int, need: int) -> PeerClosed:
        if first and got == 0:
            return PeerClosed(f"peer {self._peer} closed the connection")
        return PeerClosed(f"peer {self._peer} closed the connection in the middle of a frame "
                          f"(truncated: {got} of {need} bytes of a read)")

    # ------------------------------------------------------------------ fast path
    def _peek(self, start: int, n: int) -> memoryview:
        """``n`` unread bytes from ring offset ``start``: a view into the ring, or a copy
        when they wrap around its end."""
        ring = self._in
        if start + n <= ring.size:
            return ring.data[start:start + n]
        first = ring.size - start
        return memoryview(b"".join((ring.data[start:], ring.data[:n - first])))

    def _recv_now(self, out) -> Frame | None:
        ring = self._in
        ctrl, size = ring.ctrl, ring.size
        poll = self._poll
        native = self._native
        deadline = 0.0
        while True:
            tail = ctrl[_TAIL]
            avail = ctrl[_HEAD] - tail
            if avail >= PREAMBLE_SIZE:
                start = tail % size
                frame = None
                if native is not None:  # parses (and copies out) straight from the ring
                    r = native.parse(ring.data, start, avail, self.config.max_frame_bytes, out)
                    if type(r) is tuple:
                        frame, total = r
                    elif r > self._whole:
                        self._streamed(deadline)
                        return None
                else:
                    pre = decode_preamble(self._peek(start, PREAMBLE_SIZE), self.config.max_frame_bytes)
                    total = PREAMBLE_SIZE + pre.header_len + pre.payload_len
                    if total > self._whole:
                        self._streamed(deadline)
                        return None
                    if avail >= total:
                        body = self._peek((start + PREAMBLE_SIZE) % size, total - PREAMBLE_SIZE)
                        frame = parse_frame(pre, body, out, self._outs)  # copies out of the ring
                if frame is not None:
                    ctrl[_TAIL] = tail + total
                    if ctrl[_WRITER_WAITING]:
                        self._ring_bell()
                    if deadline:
                        poll.hit()
                    return frame
            if self._eof:
                return None
            deadline = poll.keep_spinning(deadline)
            if not deadline:
                return None

    def _streamed(self, deadline: float) -> None:
        """A frame too large to parse in place has begun: the waiting path streams it.
        Its start, if it came while this wait spun, is a hit like any frame's: the peer
        answered within the budget (else a connection carrying only such frames would
        count nothing but misses and stop spinning for good)."""
        if deadline:
            self._poll.hit()

    def _send_native(self, native, frame: Frame, user: bytes):
        cfg = self.config
        ring = self._out
        ctrl = ring.ctrl
        head = ctrl[_HEAD]
        if not self._eof:
            # A frame that fits the ring's free space is written into it whole, in one pass.
            n = native.write_ring(ring.data, head % ring.size,
                                  min(self._whole, ring.size - (head - ctrl[_TAIL])),
                                  frame.kind, user, frame.tensors, cfg.checksum_payloads,
                                  cfg.max_frame_bytes)
            if n:
                ctrl[_HEAD] = head + n
                if ctrl[_READER_WAITING]:
                    self._ring_bell()
                return None
        return self._send_encoded(frame, user)

    def _write_now(self, bufs: list) -> list[memoryview] | None:
        # A small frame goes into the ring in one copy when it has room for all of it.
        n = len(bufs[0]) + sum(b.nbytes for b in bufs[1:])
        ring = self._out
        ctrl, size = ring.ctrl, ring.size
        head = ctrl[_HEAD]
        if n <= self._whole and size - (head - ctrl[_TAIL]) >= n and not self._eof:
            blob = b"".join(bufs) if len(bufs) > 1 else bufs[0]
            start = head % size
            first = min(n, size - start)
            ring.data[start:start + first] = blob[:first]
            if n > first:
                ring.data[:n - first] = blob[first:]
            ctrl[_HEAD] = head + n
            if ctrl[_READER_WAITING]:
                self._ring_bell()
            return None
        return [byte_view(b) for b in bufs]

    # ------------------------------------------------------------------ byte stream
    def _spin_mid_frame(self, deadline: float) -> float:
        """One look of a wait inside a frame (its rest to read, or ring space to write
        it into): the deadline to spin until, or -1.0 to park now and until the wait is
        over (``deadline``: 0.0 on a wait's first look, -1.0 once its spin ran out).

        The peer is copying the other side of this very frame, so its next bytes (or
        free space) are microseconds away: parking here would cost a doorbell and a
        wake-up per piece, which made frames just over the in-place size slower than
        ones ten times larger. Such a wait spins up to the busy-poll budget whatever the
        policy says of frame starts (whose waits measure how quickly the peer answers),
        and is not counted in it; with no budget (more busy processes than cores) it
        parks, as there the spin would take the core the peer is copying on."""
        budget = self._poll.budget
        if budget <= 0 or deadline < 0:
            return -1.0
        now = time.perf_counter()
        if not deadline:
            return now + budget
        return deadline if now < deadline else -1.0

    async def _read_exact(self, view: memoryview, *, first: bool = False) -> None:
        ring = self._in
        ctrl, data, size = ring.ctrl, ring.data, ring.size
        need = view.nbytes
        pos = 0
        # A read that starts a frame has had its spin (_recv_now, under the policy); any
        # other waits for bytes the peer is writing right now.
        spin = not first
        deadline = 0.0
        turn = time.perf_counter() + _TURN_S
        while pos < need:
            if self._closed:
                raise PeerClosed(f"connection to {self._peer} is closed")
            tail = ctrl[_TAIL]
            avail = ctrl[_HEAD] - tail
            if avail == 0:
                if spin and not self._eof:
                    deadline = self._spin_mid_frame(deadline)
                    if deadline > 0:
                        continue
                ctrl[_READER_WAITING] = 1
                if ctrl[_HEAD] == tail:
                    if self._eof:
                        ctrl[_READER_WAITING] = 0
                        raise self._gone(first, pos, need)
                    await self._sleep()
                ctrl[_READER_WAITING] = 0
                continue
            spin, deadline = True, 0.0
            k = min(avail, need - pos)
            start = tail % size
            first_part = min(k, size - start)
            view[pos:pos + first_part] = data[start:start + first_part]
            if k > first_part:
                view[pos + first_part:pos + k] = data[:k - first_part]
            ctrl[_TAIL] = tail + k
            pos += k
            if ctrl[_WRITER_WAITING]:
                self._ring_bell()
            if pos < need and time.perf_counter() >= turn:
                await asyncio.sleep(0)  # the event loop's other tasks, during a huge frame
                turn = time.perf_counter() + _TURN_S

    async def _write(self, views: list[memoryview]) -> None:
        ring = self._out
        ctrl, data, size = ring.ctrl, ring.data, ring.size
        if len(views) > 1 and sum(v.nbytes for v in views) <= _COALESCE:
            views = [memoryview(b"".join(views))]  # one ring update and bell check, not one per view
        deadline = 0.0
        turn = time.perf_counter() + _TURN_S
        for view in views:
            n = view.nbytes
            pos = 0
            while pos < n:
                if self._closed:
                    raise PeerClosed(f"connection to {self._peer} is closed")
                head = ctrl[_HEAD]
                space = size - (head - ctrl[_TAIL])
                if space == 0:
                    if not self._eof:
                        deadline = self._spin_mid_frame(deadline)
                        if deadline > 0:
                            continue
                    ctrl[_WRITER_WAITING] = 1
                    if size - (head - ctrl[_TAIL]) == 0:
                        if self._eof:
                            ctrl[_WRITER_WAITING] = 0
                            raise PeerClosed(f"peer {self._peer} closed the connection")
                        await self._sleep()
                    ctrl[_WRITER_WAITING] = 0
                    continue
                if self._eof:
                    raise PeerClosed(f"peer {self._peer} closed the connection")
                k = min(space, n - pos, self._chunk)
                start = head % size
                first_part = min(k, size - start)
                data[start:start + first_part] = view[pos:pos + first_part]
                if k > first_part:
                    data[:k - first_part] = view[pos + first_part:pos + k]
                ctrl[_HEAD] = head + k
                pos += k
                deadline = 0.0
                if ctrl[_READER_WAITING]:
                    self._ring_bell()
                if time.perf_counter() >= turn:
                    await asyncio.sleep(0)  # the event loop's other tasks, during a huge frame
                    turn = time.perf_counter() + _TURN_S

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._unwatch()
        if self._safety is not None:
            self._safety.cancel()
            self._safety = None
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_exception(PeerClosed(f"connection to {self._peer} was closed"))
        self._sock.close()  # the peer sees EOF on its doorbell
        await asyncio.sleep(0)  # let woken readers/writers drop their ring views
        self._out.release()
        self._in.release()
        self._base.release()
        try:
            self._mm.close()
        except BufferError:  # a view is still referenced somewhere; the GC unmaps it
            log.debug("shared-memory ring of %s still referenced at close", self._peer)


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


async def _recv_exact(loop, sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(sock, n - len(buf))
        if not chunk:
            raise PeerClosed("peer closed the connection during the handshake")
        buf += chunk
    return bytes(buf)


async def _recv_fds(loop, sock: socket.socket) -> tuple[bytes, list[int]]:
    while True:
        try:
            return socket.recv_fds(sock, _SETUP.size, 1)[:2]
        except BlockingIOError:
            fut = loop.create_future()
            loop.add_reader(sock.fileno(), _wake, fut)
            try:
                await fut
            finally:
                loop.remove_reader(sock.fileno())


def require_same_user(sock: socket.socket, peer: str) -> None:
    """Refuse (AuthError) a connected peer that does not run as this process's user: it
    would share this process's memory through the ring."""
    _pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    if uid != os.geteuid():
        raise AuthError(f"{peer} runs as uid {uid}, this process as uid {os.geteuid()}: "
                        "shared-memory peers must be the same user")


def _map(fd: int, ring_bytes: int) -> mmap.mmap:
    """Both rings of a connection, mapped in this process (which closes ``fd``).

    Populated at once, on both sides: a page first touched mid-frame faults in each
    process that touches it, which made the first pass round a 16 MiB ring (the first
    256 frames of 64 KiB) take four times as long as the later ones. The ring's pages
    are touched anyway as frames go round it."""
    try:
        return mmap.mmap(fd, 2 * (_CTRL + ring_bytes), flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)


class ShmListener(SocketListener):
    def __init__(self, sock: socket.socket, name: str, config: TransportConfig, handler: Handler | None) -> None:
        super().__init__(sock, f"shm://{name}", config, handler)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        n = 0
        while True:
            try:
                sock, _ = await loop.sock_accept(self._sock)
            except OSError as exc:
                log.warning("accept on %s failed: %s", self._address, exc)
                await asyncio.sleep(0.1)
                continue
            n += 1
            self._spawn(self._setup(sock, f"{self._address}#{n}"))

    async def _setup(self, sock: socket.socket, peer: str) -> None:
        loop = asyncio.get_running_loop()
        sock.setblocking(False)
        try:
            async def setup() -> ShmConnection:
                require_same_user(sock, peer)
                await server_handshake(lambda b: loop.sock_sendall(sock, b),
                                       lambda n: _recv_exact(loop, sock, n), self.config.auth_token)
                msg, fds = await _recv_fds(loop, sock)
                if len(msg) != _SETUP.size or len(fds) != 1:
                    for fd in fds:
                        os.close(fd)
                    raise FrameError("bad shared-memory setup message")
                (ring_bytes,) = _SETUP.unpack(msg)
                fd = fds[0]
                if (not 64 * 1024 <= ring_bytes <= _MAX_RING or ring_bytes % 4096
                        or os.fstat(fd).st_size != 2 * (_CTRL + ring_bytes)):
                    os.close(fd)
                    raise FrameError(f"bad shared-memory ring size {ring_bytes}")
                mm = _map(fd, ring_bytes)
                await loop.sock_sendall(sock, b"A")
                return ShmConnection(sock, mm, ring_bytes, False, self.config, peer)
            conn = await with_timeout(setup(), self.config.handshake_timeout, f"handshake with {peer}")
        except (TransportError, OSError) as exc:
            log.warning("refused connection on %s: %s", self._address, exc)
            sock.close()
            return
        except BaseException:
            sock.close()
            raise
        self._deliver(conn)


class ShmTransport(Transport):
    scheme = "shm"

    @classmethod
    def availability(cls) -> str | None:
        if not hasattr(os, "memfd_create") or not hasattr(socket, "send_fds"):
            return "needs Linux memfd_create and SCM_RIGHTS (socket.send_fds)"
        return None

    async def listen(self, address: str, handler: Handler | None, config: TransportConfig) -> ShmListener:
        name = split_address(address)[1]
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(socket_address(name))
            sock.listen(1024)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise TransportError(f"cannot listen on {address}: {exc}") from exc
        return ShmListener(sock, name, config, handler)

    async def connect(self, address: str, config: TransportConfig) -> ShmConnection:
        name = split_address(address)[1]
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await with_timeout(loop.sock_connect(sock, socket_address(name)), config.connect_timeout,
                               f"connect to {address}")
        except OSError as exc:
            sock.close()
            raise PeerClosed(f"cannot connect to {address}: {exc}") from exc
        except BaseException:
            sock.close()
            raise

        async def setup() -> ShmConnection:
            require_same_user(sock, address)
            await client_handshake(lambda b: loop.sock_sendall(sock, b),
                                   lambda n: _recv_exact(loop, sock, n), config.auth_token)
            ring_bytes = config.shm_ring_bytes
            fd = os.memfd_create(f"lamina-shm-{name}", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, 2 * (_CTRL + ring_bytes))
                socket.send_fds(sock, [_SETUP.pack(ring_bytes)], [fd])
            except BaseException:
                os.close(fd)
                raise
            mm = _map(fd, ring_bytes)
            try:
                if await _recv_exact(loop, sock, 1) != b"A":
                    raise FrameError("server refused the shared-memory ring")
            except BaseException:
                mm.close()
                raise
            return ShmConnection(sock, mm, ring_bytes, True, config, address)

        try:
            return await with_timeout(setup(), config.handshake_timeout, f"handshake with {address}")
        except BaseException:
            sock.close()
            raise
