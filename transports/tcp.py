"""TCP transport (``tcp://host:port``): the always-available default.

Uses the non-blocking socket directly from the event loop rather than asyncio streams:
writes are one ``sendmsg`` of [preamble+header, payload views...] (scatter/gather, the
payloads are never copied in user space), reads go straight into the destination
tensor's memory with ``recv_into``. Small reads are served from a scratch buffer so a
small frame costs one ``recv`` syscall. The kernel's socket buffers are the only queue:
a slow receiver makes ``send`` wait for writability (backpressure, no unbounded buffer).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket

from .base import Handler, Listener, StreamConnection, Transport, parse_host_port, with_timeout
from .config import TransportConfig
from .errors import PeerClosed, TransportError
from .handshake import client_handshake, server_handshake

log = logging.getLogger(__name__)

_SCRATCH = 256 * 1024
_IOV_MAX = 512
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
        self._waiters: dict[bool, asyncio.Future] = {}  # writable? -> future

    @property
    def peer(self) -> str:
        return self._peer

    async def _wait(self, writable: bool) -> None:
        fut = self._loop.create_future()
        self._waiters[writable] = fut
        if writable:
            self._loop.add_writer(self._fd, _wake, fut)
        else:
            self._loop.add_reader(self._fd, _wake, fut)
        try:
            await fut
        finally:
            self._waiters.pop(writable, None)
            if not self._closed:
                if writable:
                    self._loop.remove_writer(self._fd)
                else:
                    self._loop.remove_reader(self._fd)

    async def _recv_some(self, view: memoryview) -> int:
        while True:
            if self._closed:
                raise PeerClosed(f"connection to {self._peer} is closed")
            try:
                return self._sock.recv_into(view)
            except BlockingIOError:
                await self._wait(False)
            except _PEER_GONE as exc:
                raise PeerClosed(f"connection to {self._peer} lost: {exc}") from None
            except OSError as exc:
                if self._closed or exc.errno == errno.EBADF:
                    raise PeerClosed(f"connection to {self._peer} is closed") from None
                raise TransportError(f"recv from {self._peer} failed: {exc}") from exc

    def _eof(self, first: bool, got: int, need: int) -> PeerClosed:
        if first and got == 0:
            return PeerClosed(f"peer {self._peer} closed the connection")
        return PeerClosed(f"peer {self._peer} closed the connection in the middle of a frame "
                          f"(truncated: {got} of {need} bytes of a read)")

    async def _read_small(self, n: int, *, first: bool = False) -> bytes | memoryview:
        start = self._rstart
        if self._rend - start >= n:  # already buffered: parse in place, no copy
            self._rstart = start + n
            return self._rview[start:start + n]
        return await super()._read_small(n, first=first)

    async def _read_exact(self, view: memoryview, *, first: bool = False) -> None:
        need = view.nbytes
        pos = min(self._rend - self._rstart, need)
        if pos:
            view[:pos] = self._rview[self._rstart:self._rstart + pos]
            self._rstart += pos
        while pos < need:
            remaining = need - pos
            if remaining >= _SCRATCH // 2:
                n = await self._recv_some(view[pos:])  # straight into the destination
                if n == 0:
                    raise self._eof(first, pos, need)
                pos += n
            else:
                n = await self._recv_some(self._rview)
                if n == 0:
                    raise self._eof(first, pos, need)
                take = min(n, remaining)
                view[pos:pos + take] = self._rview[:take]
                self._rstart, self._rend = take, n
                pos += take

    async def _write(self, views: list[memoryview]) -> None:
        sock = self._sock
        while views:
            if self._closed:
                raise PeerClosed(f"connection to {self._peer} is closed")
            try:
                sent = sock.sendmsg(views[:_IOV_MAX], (), socket.MSG_NOSIGNAL)
            except BlockingIOError:
                await self._wait(True)
                continue
            except _PEER_GONE as exc:
                raise PeerClosed(f"connection to {self._peer} lost: {exc}") from None
            except OSError as exc:
                if self._closed or exc.errno == errno.EBADF:
                    raise PeerClosed(f"connection to {self._peer} is closed") from None
                raise TransportError(f"send to {self._peer} failed: {exc}") from exc
            i = 0
            while i < len(views) and sent >= views[i].nbytes:
                sent -= views[i].nbytes
                i += 1
            views = views[i:]
            if sent:
                views[0] = views[0][sent:]

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for writable, fut in list(self._waiters.items()):
            if writable:
                self._loop.remove_writer(self._fd)
            else:
                self._loop.remove_reader(self._fd)
            if not fut.done():
                fut.set_exception(PeerClosed(f"connection to {self._peer} was closed"))
        self._sock.close()

    # Handshake helpers (raw bytes before framing starts).
    async def _send_raw(self, data: bytes) -> None:
        await self._write([memoryview(data)])

    async def _recv_raw(self, n: int) -> bytes:
        buf = bytearray(n)
        await self._read_exact(memoryview(buf), first=True)
        return bytes(buf)


class TcpListener(Listener):
    def __init__(self, sock: socket.socket, config: TransportConfig, handler: Handler | None) -> None:
        super().__init__(config, handler)
        self._sock = sock
        host, port = sock.getsockname()[:2]
        self._address = f"tcp://{host}:{port}" if ":" not in host else f"tcp://[{host}]:{port}"
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop())

    @property
    def address(self) -> str:
        return self._address

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

    async def _stop_accepting(self) -> None:
        self._accept_task.cancel()
        await asyncio.gather(self._accept_task, return_exceptions=True)
        self._sock.close()


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
        try:
            await with_timeout(client_handshake(conn._send_raw, conn._recv_raw, config.auth_token),
                               config.handshake_timeout, f"handshake with {address}")
        except BaseException:
            await conn.close()
            raise
        return conn
