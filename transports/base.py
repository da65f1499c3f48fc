"""The transport interface: Transport, Connection, Listener.

Ownership rules:
- A ``Connection`` owns its socket/ring/endpoint; ``close()`` releases them and is idempotent.
- A ``Listener`` owns its accept task, the handler task of every accepted connection and
  those connections; ``close()`` stops accepting, cancels and awaits every handler task,
  then closes the connections.
- One ``send`` and one ``recv`` may run at a time per connection (concurrent callers are
  serialized by locks), so a frame is never interleaved with another.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar
from urllib.parse import urlsplit

import msgpack

from . import frame as _frame
from .config import TransportConfig
from .errors import FrameError, PeerClosed, TransportError, TransportTimeout
from .frame import (
    PREAMBLE_SIZE,
    Buffer,
    Frame,
    OutViews,
    allocate,
    byte_view,
    check_payload_crcs,
    decode_header,
    decode_preamble,
    encode,
    pack_user_header,
)
from .handshake import client_handshake
from .host_staging import HostStaging, has_cuda
from .polling import BusyPoll

log = logging.getLogger(__name__)

T = TypeVar("T")

Handler = Callable[["Connection"], Awaitable[None]]


def split_address(address: str) -> tuple[str, str]:
    """``"tcp://host:port"`` -> ``("tcp", "host:port")``."""
    scheme, sep, rest = address.partition("://")
    if not sep or not scheme:
        raise ValueError(f"transport address needs a scheme, e.g. tcp://host:port; got {address!r}")
    return scheme.lower(), rest


def parse_host_port(address: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    parts = urlsplit(address)
    host = parts.hostname or default_host
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"bad port in {address!r}") from exc
    if port is None:
        raise ValueError(f"address {address!r} needs a port (use :0 to pick a free one)")
    return host, port


class _Mutex:
    """A FIFO async mutex whose uncontended acquire costs one attribute test and store.

    ``asyncio.Lock`` costs three coroutine calls per use, which shows in the per-frame
    profile; here the caller tests ``busy`` and sets it itself when it is false, and only
    a contended acquire awaits. Ownership passes directly to the next waiter on release
    (``busy`` stays true), so a waiter can never be overtaken.
    """

    __slots__ = ("_waiters", "busy")

    def __init__(self) -> None:
        self.busy = False
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    async def acquire(self) -> None:
        if not self.busy:
            self.busy = True
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # ownership was handed to us just as we were cancelled
            else:
                with contextlib.suppress(ValueError):  # already skipped by release()
                    self._waiters.remove(fut)
            raise

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # hand over: busy stays True
                return
        self.busy = False


class Connection(abc.ABC):
    """One bidirectional, ordered, reliable stream of frames."""

    stages_cuda = True  # CUDA tensors go through pinned host memory (False: the transport carries them)

    def __init__(self, config: TransportConfig) -> None:
        self.config = config
        self._send_lock = _Mutex()
        self._recv_lock = _Mutex()
        self._closed = False
        self._close_reason: str | None = None
        self._staging: HostStaging | None = None  # pinned buffers for CUDA tensors, made on first use

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    @abc.abstractmethod
    def peer(self) -> str:
        """The peer's address, for logs."""

    async def send(self, frame: Frame, *, timeout: float | None = None) -> None:  # noqa: ASYNC109 (see with_timeout)
        """Send one frame; returns when its bytes are handed to the transport.

        Waits (bounded by the transport's buffer) while the receiver is slow: there is no
        unbounded sender-side queue. CUDA tensors are staged through pinned host memory
        (transports/host_staging.py) where the transport carries host memory.
        """
        lock = self._send_lock
        if lock.busy:
            await lock.acquire()
        else:
            lock.busy = True  # uncontended: no coroutine, no future (the common case)
        try:
            self._check_open()
            if self.stages_cuda and has_cuda(frame):
                if self._staging is None:
                    self._staging = HostStaging()
                frame = await self._staging.stage(frame)
            rest = self._start_send(frame)
            if rest is None:
                return  # all of it left without waiting (the common case for small frames)
            timeout = self.config.send_timeout if timeout is None else timeout
            if timeout is None:
                await rest
            else:
                try:
                    async with asyncio.timeout(timeout):
                        await rest
                except TimeoutError:
                    # Part of the frame may be on the wire: the stream cannot be resumed.
                    await self._abort(f"send timed out after {timeout}s")
                    raise TransportTimeout(f"send to {self.peer} timed out after {timeout}s") from None
        finally:
            lock.release()

    def _start_send(self, frame: Frame) -> Awaitable[None] | None:
        """Send what can leave without waiting; return an awaitable that finishes the
        frame, or ``None`` when all of it left. Raises FrameError, before anything is
        written, for a frame that cannot be encoded."""
        return self._send_frame(frame)

    async def recv(self, *, out: Sequence[Buffer | None] | None = None,
                   timeout: float | None = None) -> Frame:  # noqa: ASYNC109 (see with_timeout)
        """Receive the next frame.

        ``out`` optionally gives preallocated destinations (contiguous CPU tensors or
        writable buffers) for the frame's buffers in order: ``None`` entries and buffers
        past the end of ``out`` are allocated, unused entries are ignored, and an entry
        whose size differs from the buffer's is a FrameError.
        A recv that times out before the frame started leaves the connection usable; one
        that times out (or is cancelled) mid-frame closes it.
        """
        timeout = self.config.recv_timeout if timeout is None else timeout
        if out is not None and type(out) is not list:
            out = list(out)  # the native codec takes a list (or None)
        lock = self._recv_lock
        if lock.busy:
            await lock.acquire()
        else:
            lock.busy = True
        try:
            self._check_open()
            try:
                frame = self._recv_now(out)
            except FrameError as exc:
                await self._abort(str(exc))
                raise
            if frame is not None:
                return frame
            if timeout is None:
                return await self._guarded_recv(out)
            try:
                async with asyncio.timeout(timeout):
                    return await self._guarded_recv(out)
            except TimeoutError:
                raise TransportTimeout(f"recv from {self.peer} timed out after {timeout}s") from None
        finally:
            lock.release()

    def _recv_now(self, out) -> Frame | None:
        """A whole frame that is already here (or arrives within the busy-poll budget),
        taken without waiting; ``None`` sends the caller down the waiting path. It never
        consumes part of a frame."""
        return None

    async def _guarded_recv(self, out) -> Frame:
        try:
            return await self._recv_frame(out)
        except FrameError as exc:
            await self._abort(str(exc))
            raise
        except PeerClosed as exc:
            await self._abort(str(exc), quiet=True)
            raise
        except BaseException:
            if self._mid_frame():
                await self._abort("receive interrupted in the middle of a frame")
            raise

    def _check_open(self) -> None:
        if self._closed:
            raise PeerClosed(f"connection to {self.peer} is closed"
                             + (f": {self._close_reason}" if self._close_reason else ""))

    async def _abort(self, reason: str, *, quiet: bool = False) -> None:
        if not self._closed:
            (log.debug if quiet else log.warning)("closing connection to %s: %s", self.peer, reason)
            self._close_reason = reason
        await self.close()

    @abc.abstractmethod
    async def _send_frame(self, frame: Frame) -> None: ...

    @abc.abstractmethod
    async def _recv_frame(self, out) -> Frame: ...

    def _mid_frame(self) -> bool:
        """True when a partially received frame has desynchronized the stream."""
        return True

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the connection; idempotent. A peer blocked in recv gets PeerClosed."""

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def advance(views: list[memoryview], sent: int) -> list[memoryview]:
    """What is left of ``views`` after ``sent`` bytes of them were written."""
    i = 0
    while i < len(views) and sent >= views[i].nbytes:
        sent -= views[i].nbytes
        i += 1
    views = views[i:]
    if sent:
        views[0] = views[0][sent:]
    return views


class StreamConnection(Connection):
    """Framing over an ordered byte stream (TCP socket, shared-memory ring).

    Subclasses provide ``_write(views)`` (send all bytes of the views, in order) and
    ``_read_exact(view)`` (fill the view completely or raise PeerClosed).
    """

    def __init__(self, config: TransportConfig) -> None:
        super().__init__(config)
        self._in_frame = False
        self._packer = msgpack.Packer(use_bin_type=True)  # reused for every frame's header
        self._poll = BusyPoll(config.busy_poll_budget_us)  # used by transports with a _recv_now
        self._outs = OutViews()
        # The native codec (transports/_wire) or None: read at connection set-up, so that
        # setting lamina.transports.frame.NATIVE to None switches new connections to Python.
        self._native = _frame.NATIVE if config.native_frames else None

    def _mid_frame(self) -> bool:
        return self._in_frame

    @abc.abstractmethod
    async def _write(self, views: list[memoryview]) -> None: ...

    @abc.abstractmethod
    async def _read_exact(self, view: memoryview, *, first: bool = False) -> None:
        """``first``: this read starts a frame (EOF before it is a clean close)."""

    async def _read_small(self, n: int, *, first: bool = False) -> bytes | bytearray | memoryview:
        """``n`` bytes, possibly as a view that is valid only until the next read."""
        buf = bytearray(n)
        await self._read_exact(memoryview(buf), first=first)
        return buf

    def _start_send(self, frame: Frame) -> Awaitable[None] | None:
        native = self._native
        if native is None:
            return self._send_encoded(frame)
        return self._send_native(native, frame, pack_user_header(frame.header, self._packer))

    def _send_native(self, native, frame: Frame, user: bytes) -> Awaitable[None] | None:
        """Send ``frame`` through the native codec ``native`` where the transport can
        (``user``: its header's msgpack); by default through the Python codec."""
        return self._send_encoded(frame, user)

    def _send_encoded(self, frame: Frame, user: bytes | None = None,
                      left: int | None = None) -> Awaitable[None] | None:
        """Send ``frame`` encoded by the Python codec. ``user``: its header's msgpack
        when packed already; ``left``: the native codec wrote all but this many bytes of
        the frame (the codecs produce the same bytes, so the rest follows from here)."""
        head, bufs = encode(frame, checksum_payloads=self.config.checksum_payloads,
                            max_frame_bytes=self.config.max_frame_bytes, packer=self._packer,
                            user=user)
        bufs.insert(0, head)
        if left is None:
            rest = self._write_now(bufs)
            return None if rest is None else self._finish_send(rest)
        views = [byte_view(b) for b in bufs]
        return self._finish_send(advance(views, sum(v.nbytes for v in views) - left))

    async def _send_frame(self, frame: Frame) -> None:
        rest = self._start_send(frame)
        if rest is not None:
            await rest

    def _write_now(self, bufs: list) -> list[memoryview] | None:
        """Write what fits without waiting; return the unwritten rest as byte views, or
        ``None`` when everything was written. By default nothing is written here."""
        return [byte_view(b) for b in bufs]

    async def _finish_send(self, views: list[memoryview]) -> None:
        try:
            await self._write(views)
        except BaseException:
            await self._abort("send interrupted in the middle of a frame")
            raise

    async def _recv_frame(self, out) -> Frame:
        cfg = self.config
        pre = decode_preamble(await self._read_small(PREAMBLE_SIZE, first=True), cfg.max_frame_bytes)
        self._in_frame = True
        user, metas, crcs = decode_header(pre, await self._read_small(pre.header_len))
        return await self._read_payloads(pre, user, metas, crcs, out)

    async def _read_payloads(self, pre, user, metas, crcs, out) -> Frame:
        """The rest of a frame whose header is decoded: each payload read straight into
        its destination (``out`` entry or a new buffer), then checked."""
        buffers: list[Buffer] = []
        views: list[memoryview] = []
        for i, meta in enumerate(metas):
            obj, view = allocate(meta, out[i] if out is not None and i < len(out) else None)
            if view.nbytes:
                await self._read_exact(view)
            buffers.append(obj)
            views.append(view)
        self._in_frame = False
        check_payload_crcs(views, crcs)
        return Frame(pre.kind, user, buffers)


class Listener(abc.ABC):
    """Accepts connections at ``address``.

    With a handler, each accepted connection is passed to ``handler(conn)`` in its own
    task (the connection is closed when the handler returns); without one, connections
    are queued for ``accept()``. A failed handshake or a bad frame on one connection
    never stops the listener.
    """

    def __init__(self, config: TransportConfig, handler: Handler | None) -> None:
        self.config = config
        self._handler = handler
        self._queue: asyncio.Queue[Connection] = asyncio.Queue()
        self._tasks: set[asyncio.Task] = set()
        self._connections: set[Connection] = set()
        self._closed = False

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """The bound address (with the real port when ``:0`` was asked for)."""

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _deliver(self, conn: Connection) -> None:
        """Called by implementations with each connection that passed the handshake."""
        if self._closed:
            self._spawn(conn.close())
            return
        self._connections.add(conn)
        if self._handler is None:
            self._queue.put_nowait(conn)
        else:
            self._spawn(self._run_handler(self._handler, conn))

    async def _run_handler(self, handler: Handler, conn: Connection) -> None:
        try:
            await handler(conn)
        except TransportError as exc:
            log.info("connection from %s ended: %s", conn.peer, exc)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("handler for connection from %s failed", conn.peer)
        finally:
            self._connections.discard(conn)
            await conn.close()

    async def accept(self) -> Connection:
        if self._handler is not None:
            raise RuntimeError("accept() is for listeners created without a handler")
        if self._closed:
            raise TransportError("listener is closed")
        return await self._queue.get()

    async def close(self) -> None:
        """Stop accepting, cancel and await handler tasks, close every connection."""
        if self._closed:
            return
        self._closed = True
        await self._stop_accepting()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for conn in list(self._connections):
            await conn.close()
        self._connections.clear()
        while not self._queue.empty():
            await self._queue.get_nowait().close()

    @abc.abstractmethod
    async def _stop_accepting(self) -> None: ...

    async def __aenter__(self) -> Listener:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class SocketListener(Listener):
    """A listener that accepts on a socket of its own, in one accept task it owns.

    Subclasses implement ``_accept_loop`` (accept, handshake, ``_deliver``); closing
    cancels and awaits that task, then closes the socket.
    """

    def __init__(self, sock: socket.socket, address: str, config: TransportConfig,
                 handler: Handler | None) -> None:
        super().__init__(config, handler)
        self._sock = sock
        self._address = address
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop())

    @property
    def address(self) -> str:
        return self._address

    @abc.abstractmethod
    async def _accept_loop(self) -> None: ...

    async def _stop_accepting(self) -> None:
        self._accept_task.cancel()
        await asyncio.gather(self._accept_task, return_exceptions=True)
        self._sock.close()


class Transport(abc.ABC):
    """A way of moving frames; selected by URL scheme through ``lamina.transports.registry``."""

    scheme: str

    @classmethod
    def availability(cls) -> str | None:
        """``None`` when this transport can run here, else the reason it cannot."""
        return None

    @abc.abstractmethod
    async def listen(self, address: str, handler: Handler | None, config: TransportConfig) -> Listener: ...

    @abc.abstractmethod
    async def connect(self, address: str, config: TransportConfig) -> Connection: ...


class HandshakeStream(Protocol):
    """A connection that carries the handshake's raw bytes before framing starts (TCP, UCX)."""

    async def _send_raw(self, data: bytes) -> None: ...

    async def _recv_raw(self, n: int) -> bytes: ...

    async def close(self) -> None: ...


async def client_handshake_or_close(conn: HandshakeStream, config: TransportConfig,
                                    address: str) -> None:
    """Run the client side of the handshake on a new connection; close it on failure."""
    try:
        await with_timeout(client_handshake(conn._send_raw, conn._recv_raw, config.auth_token),
                           config.handshake_timeout, f"handshake with {address}")
    except BaseException:
        await conn.close()
        raise


async def with_timeout(aw: Awaitable[T], timeout: float | None, what: str) -> T:  # noqa: ASYNC109 (see below)
    """Await ``aw`` within ``timeout`` seconds (None: no limit). The transports take a timeout
    argument rather than leaving it to the caller's ``asyncio.timeout`` so that expiry
    raises TransportTimeout, which names what timed out."""
    if timeout is None:
        return await aw
    try:
        async with asyncio.timeout(timeout):
            return await aw
    except TimeoutError:
        raise TransportTimeout(f"{what} timed out after {timeout}s") from None
