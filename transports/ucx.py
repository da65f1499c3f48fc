"""UCX transport through ``ucxx`` (``ucx://host:port``).

UCX picks the wire (``UCX_TLS``): tcp and shared memory on these machines, RDMA and GPU
memory on a cluster whose UCX is built for them. ``ucxx`` is imported only when this
transport is used, and its progress mode (``TransportConfig.ucx_progress_mode``, default
"blocking": the event loop waits on the UCX worker's event descriptor) is set before it
starts.

A frame is sent as tagged messages on the endpoint, as few as its size allows (each
UCX message costs a request and a completion): a frame of at most ``_INLINE`` bytes is
one message, received into the connection's scratch buffer and parsed there; a larger
one is the preamble and header in one message (two when the header alone is larger
than ``_INLINE``) followed by one message per non-empty payload buffer, each received
straight into its destination.

On UCX a receive that times out or is cancelled closes the connection: the posted
UCX receive cannot be withdrawn, so the message stream could not be trusted afterwards.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
from collections.abc import Sequence
from typing import Any

from .base import (
    Handler,
    Listener,
    StreamConnection,
    Transport,
    client_handshake_or_close,
    parse_host_port,
    with_timeout,
)
from .config import TransportConfig
from .errors import FrameError, PeerClosed, TransportError
from .frame import (
    PREAMBLE_SIZE,
    Frame,
    decode_header,
    decode_preamble,
    encode,
    parse_frame,
)
from .handshake import server_handshake

log = logging.getLogger(__name__)

_INLINE = 64 * 1024  # frames up to this size travel as one UCX message


def _ucxx(config: TransportConfig):
    if config.ucx_tls is not None:
        os.environ["UCX_TLS"] = config.ucx_tls  # read by UCX when it first initializes
    # Read by ucxx when its context starts; an explicit environment setting wins.
    os.environ.setdefault("UCXPY_PROGRESS_MODE", config.ucx_progress_mode)
    # ucxx sets UCX_MEMTYPE_CACHE, which this UCX no longer reads and warns of on every
    # process's stderr (`lamina profile` printed four such lines); other warnings stay.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx
    return ucxx


def _translate(exc: BaseException, peer: str) -> TransportError:
    name = type(exc).__name__
    if "Truncated" in name or "MessageTruncated" in str(exc):
        return FrameError(f"UCX message from {peer} does not fit the frame's buffer: {exc}")
    return PeerClosed(f"UCX connection to {peer} failed: {name}: {exc}")


class UcxConnection(StreamConnection):
    def __init__(self, ep, config: TransportConfig, peer: str) -> None:
        super().__init__(config)
        self._ep = ep
        self._peer = peer
        self._scratch = memoryview(bytearray(_INLINE))
        # A small frame is built here by the native codec; sends are serialized by the
        # send lock and complete before it is released, so one buffer serves them all.
        self._send_scratch = memoryview(bytearray(_INLINE))

    @property
    def peer(self) -> str:
        return self._peer

    def _mid_frame(self) -> bool:
        return True

    def _send_native(self, native, frame: Frame, user: bytes):
        cfg = self.config
        n = native.write_ring(self._send_scratch, 0, _INLINE, frame.kind, user, frame.tensors,
                              cfg.checksum_payloads, cfg.max_frame_bytes)
        if n:
            return self._finish_send([self._send_scratch[:n]])
        return self._send_encoded(frame, user)

    def _send_encoded(self, frame: Frame, user: bytes | None = None, left: int | None = None):
        # Nothing is written before this on UCX (``left`` is always None here).
        cfg = self.config
        head, bufs = encode(frame, checksum_payloads=cfg.checksum_payloads,
                            max_frame_bytes=cfg.max_frame_bytes, packer=self._packer, user=user)
        total = len(head) + sum(b.nbytes for b in bufs)
        messages: list[Any]  # bytes, arrays and views: each is one UCX message, sent whole
        if total <= _INLINE:
            messages = [b"".join((head, *bufs)) if bufs else head]
        elif len(head) <= _INLINE:
            messages = [head, *bufs]
        else:
            mv = memoryview(head)
            messages = [mv[:PREAMBLE_SIZE], mv[PREAMBLE_SIZE:], *bufs]
        return self._finish_send(messages)

    async def _recv_frame(self, out) -> Frame:
        scratch = self._scratch
        await self._read_exact(scratch, first=True)  # the frame's first message, <= _INLINE bytes
        if self._native is not None:
            r = self._native.parse(scratch, 0, _INLINE, self.config.max_frame_bytes, out)
            if type(r) is tuple:
                return r[0]
        pre = decode_preamble(scratch, self.config.max_frame_bytes)
        hlen = pre.header_len
        head_len = PREAMBLE_SIZE + hlen
        if head_len + pre.payload_len <= _INLINE:
            return parse_frame(pre, scratch[PREAMBLE_SIZE:head_len + pre.payload_len], out, self._outs)
        if head_len <= _INLINE:
            header = scratch[PREAMBLE_SIZE:head_len]
        else:
            header = memoryview(bytearray(hlen))
            await self._read_exact(header)
        user, metas, crcs = decode_header(pre, header)
        return await self._read_payloads(pre, user, metas, crcs, out)

    async def _write(self, views: Sequence[Any]) -> None:
        # Any buffers (see _send_encoded): the endpoint sends each as one message.
        for v in views:
            if self._closed:
                raise PeerClosed(f"connection to {self._peer} is closed")
            try:
                await self._ep.send(v)
            except (asyncio.CancelledError, TransportError):
                raise
            except Exception as exc:
                raise _translate(exc, self._peer) from exc

    async def _read_exact(self, view: memoryview, *, first: bool = False) -> None:
        if self._closed:
            raise PeerClosed(f"connection to {self._peer} is closed")
        try:
            await self._ep.recv(view)
        except (asyncio.CancelledError, TransportError):
            raise
        except Exception as exc:
            raise _translate(exc, self._peer) from exc

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._ep.close()
        except Exception as exc:  # the peer may already be gone
            log.debug("closing UCX endpoint to %s: %s", self._peer, exc, exc_info=True)

    async def _send_raw(self, data: bytes) -> None:
        await self._write([memoryview(data)])

    async def _recv_raw(self, n: int) -> bytes:
        buf = bytearray(n)
        await self._read_exact(memoryview(buf))
        return bytes(buf)


class UcxListener(Listener):
    def __init__(self, ucxx, host: str, port: int, config: TransportConfig, handler: Handler | None) -> None:
        super().__init__(config, handler)
        self._listener = ucxx.create_listener(self._on_endpoint, port=port)
        if host in ("0.0.0.0", "", "::"):
            host = ucxx.get_address()
        self._address = f"ucx://{host}:{self._listener.port}"
        self._count = 0

    @property
    def address(self) -> str:
        return self._address

    async def _on_endpoint(self, ep) -> None:
        if self._closed:
            await ep.close()
            return
        self._count += 1
        conn = UcxConnection(ep, self.config, f"{self._address}#{self._count}")
        try:
            await with_timeout(server_handshake(conn._send_raw, conn._recv_raw, self.config.auth_token),
                               self.config.handshake_timeout, f"handshake with {conn.peer}")
        except (TransportError, OSError) as exc:
            log.warning("refused connection on %s: %s", self._address, exc)
            await conn.close()
            return
        self._deliver(conn)

    async def _stop_accepting(self) -> None:
        self._listener.close()


class UcxTransport(Transport):
    scheme = "ucx"

    @classmethod
    def availability(cls) -> str | None:
        if importlib.util.find_spec("ucxx") is None:
            return "ucxx is not installed (pip install 'lamina[ucx]', i.e. ucxx-cu12)"
        return None

    async def listen(self, address: str, handler: Handler | None, config: TransportConfig) -> UcxListener:
        host, port = parse_host_port(address)
        ucxx = _ucxx(config)
        try:
            return UcxListener(ucxx, host, port, config, handler)
        except Exception as exc:
            raise TransportError(f"cannot listen on {address}: {exc}") from exc

    async def connect(self, address: str, config: TransportConfig) -> UcxConnection:
        host, port = parse_host_port(address)
        ucxx = _ucxx(config)
        try:
            ep = await with_timeout(
                ucxx.create_endpoint(host, port, connect_timeout=config.connect_timeout or 5.0),
                config.connect_timeout, f"connect to {address}")
        except TransportError:
            raise
        except Exception as exc:
            raise PeerClosed(f"cannot connect to {address}: {exc}") from exc
        conn = UcxConnection(ep, config, f"{host}:{port}")
        await client_handshake_or_close(conn, config, address)
        return conn
