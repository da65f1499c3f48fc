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

CUDA tensors travel from device memory where ucxx reports CUDA support and UCX may use
its CUDA transports (``TransportConfig.ucx_device_memory``, on by default; ``UCX_TLS``
unset, "all", or naming a cuda transport): a frame that holds any is sent as a notice
(a frame of no buffers whose header, a msgpack extension, lists each CUDA tensor's place,
dtype and shape), then the frame itself with an empty buffer in each such place, then
one UCX message per CUDA tensor straight from its memory, once the stream that computed
it is done. The receiver puts them in new tensors on its current CUDA device (host memory
where it has none), or in the caller's ``out`` entries. Those payloads carry no crc32 of
their own (the frame and notice keep theirs); their bytes count against
``max_frame_bytes`` with the frame's. Elsewhere CUDA tensors are staged through pinned
host memory, as on tcp.

On UCX a receive that times out or is cancelled closes the connection: the posted
UCX receive cannot be withdrawn, so the message stream could not be trusted afterwards.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import math
import os
from collections.abc import Sequence
from typing import Any

import msgpack
import torch

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
    DTYPES,
    MAX_NDIM,
    PREAMBLE_SIZE,
    Frame,
    buffer_nbytes,
    decode_header,
    decode_preamble,
    encode,
    parse_frame,
    tensor_view,
)
from .handshake import server_handshake
from .host_staging import until_done

log = logging.getLogger(__name__)

_INLINE = 64 * 1024  # frames up to this size travel as one UCX message
# The msgpack extension code of a notice's header (no user header decodes to an extension).
_DIRECT = 17
_NAMES = {d: n for n, d in DTYPES.items()}
# No dimension, nor the elements of a notice's tensor, reach this (torch refuses such
# shapes even empty; the frame's byte bound catches the rest).
_MAX_DIM = 1 << 48


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


def _device_memory(ucxx, config: TransportConfig) -> bool:
    """Whether this process sends CUDA tensors from device memory: asked for, a CUDA
    device here, UCX built with CUDA support, and its transports not narrowed to
    host-only ones."""
    if not (config.ucx_device_memory and torch.cuda.is_available()):
        return False
    tls = os.environ.get("UCX_TLS")
    if tls is not None and "all" not in tls and "cuda" not in tls:
        return False
    return bool(ucxx.core._get_ctx().context.cuda_support)


def _sends_direct(t: Any) -> bool:
    """Whether a buffer of an outgoing frame travels as a message of its own memory."""
    return isinstance(t, torch.Tensor) and t.is_cuda


def _notice(frame: Frame) -> tuple[Frame, Frame, list[torch.Tensor]] | None:
    """For a frame with buffers that travel directly: the notice, the frame with an empty
    buffer in their places, and those tensors (contiguous, in place order); else None."""
    places = {i: t for i, t in enumerate(frame.tensors) if _sends_direct(t) and isinstance(t, torch.Tensor)}
    if not places:
        return None
    tensors = list(frame.tensors)
    items, direct = [], []
    for i, t in places.items():
        t = t.detach().resolve_conj().resolve_neg()  # a byte view refuses the lazy bits
        if t.dtype not in _NAMES:
            raise FrameError(f"unsupported tensor dtype {t.dtype}")
        if t.dim() > MAX_NDIM:
            raise FrameError(f"a frame carries tensors of at most {MAX_NDIM} dimensions, got {t.dim()}")
        direct.append(t.contiguous())
        items.append([i, _NAMES[t.dtype], list(t.shape)])
        tensors[i] = b""
    notice = Frame(0, msgpack.ExtType(_DIRECT, msgpack.packb(items)), [])
    return notice, Frame(frame.kind, frame.header, tensors), direct


def _read_notice(header: msgpack.ExtType) -> list[tuple[int, torch.dtype, tuple[int, ...], int]]:
    """A notice's (place, dtype, shape, bytes) per tensor, checked."""
    try:
        items = msgpack.unpackb(header.data)
        out = []
        for i, name, shape in items:
            shape = tuple(shape)
            if (type(i) is not int or i < 0 or len(shape) > MAX_NDIM
                    or any(type(n) is not int or not 0 <= n < _MAX_DIM for n in shape)
                    or math.prod(n for n in shape if n) >= _MAX_DIM):
                raise ValueError(f"bad entry {[i, name, list(shape)]}")
            dtype = DTYPES[name]
            out.append((i, dtype, shape, dtype.itemsize * math.prod(shape)))
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
        raise FrameError(f"UCX notice of device buffers is malformed: {exc}") from exc
    if len({i for i, *_ in out}) != len(out):
        raise FrameError("UCX notice of device buffers names a place twice")
    return out


def _bytes_of(t: torch.Tensor) -> Any:
    """A contiguous tensor's memory as UCX sends or receives it: device memory as a flat
    byte tensor (CUDA's array interface has no bfloat16), host memory as a byte view."""
    return t.reshape(-1).view(torch.uint8) if t.is_cuda else tensor_view(t)


async def _current_streams_done(tensors: Sequence[torch.Tensor]) -> None:
    """Returns once the work queued on the current stream of each CUDA tensor's device is
    done (its event polled, other tasks running meanwhile): before UCX touches their
    memory, which it does outside the streams' order."""
    for device in {t.device for t in tensors if t.is_cuda}:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        await until_done(done)


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
        # CUDA tensors sent from device memory (else staged through host memory, as on tcp).
        self.stages_cuda = not _device_memory(_ucxx(config), config)
        # Receive buffers UCX may still write into after their receive was given up (a
        # cancelled or timed-out frame: UCX cannot cancel a receive already matched), kept
        # for as long as the connection object lives instead of freed for reuse.
        self._orphans: list[Any] = []

    @property
    def peer(self) -> str:
        return self._peer

    def _receive_device(self) -> torch.device:
        """Where a peer's device payloads arrive: this process's current CUDA device where
        its UCX takes device memory and the process computes on a GPU (CUDA initialized by
        then), else host memory, as a staged frame's would. A CPU service on a GPU host
        so never starts a CUDA context for what it reads on the CPU."""
        if not self.stages_cuda and torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _mid_frame(self) -> bool:
        return True

    def _start_send(self, frame: Frame):
        split = None if self.stages_cuda else _notice(frame)
        if split is None:
            return super()._start_send(frame)
        notice, rest, direct = split
        # Every check before anything is written: both frames encode, and fit the bound together.
        messages = self._messages(notice) + self._messages(rest)
        size = sum(memoryview(m).nbytes for m in messages) + sum(t.nbytes for t in direct)
        if size > self.config.max_frame_bytes:
            raise FrameError(f"frame of {size} bytes exceeds max_frame_bytes={self.config.max_frame_bytes}")
        return self._send_direct(messages, direct)

    async def _send_direct(self, messages: list[Any], direct: list[torch.Tensor]) -> None:
        await _current_streams_done(direct)  # UCX reads them outside the streams' order
        await self._finish_send(messages + [_bytes_of(t) for t in direct if t.nbytes])

    def _send_native(self, native, frame: Frame, user: bytes):
        cfg = self.config
        n = native.write_ring(self._send_scratch, 0, _INLINE, frame.kind, user, frame.tensors,
                              cfg.checksum_payloads, cfg.max_frame_bytes)
        if n:
            return self._finish_send([self._send_scratch[:n]])
        return self._send_encoded(frame, user)

    def _send_encoded(self, frame: Frame, user: bytes | None = None, left: int | None = None):
        # Nothing is written before this on UCX (``left`` is always None here).
        return self._finish_send(self._messages(frame, user))

    def _messages(self, frame: Frame, user: bytes | None = None) -> list[Any]:
        """The UCX messages of one frame: bytes, arrays and views, each sent whole."""
        cfg = self.config
        head, bufs = encode(frame, checksum_payloads=cfg.checksum_payloads,
                            max_frame_bytes=cfg.max_frame_bytes, packer=self._packer, user=user)
        total = len(head) + sum(b.nbytes for b in bufs)
        if total <= _INLINE:
            return [b"".join((head, *bufs)) if bufs else head]
        if len(head) <= _INLINE:
            return [head, *bufs]
        mv = memoryview(head)
        return [mv[:PREAMBLE_SIZE], mv[PREAMBLE_SIZE:], *bufs]

    async def _recv_frame(self, out) -> Frame:
        frame = await self._recv_one(out)
        header = frame.header
        if type(header) is not msgpack.ExtType or header.code != _DIRECT:
            return frame
        # A notice: the frame follows, then its device payloads.
        items = _read_notice(header)
        places = {i for i, *_ in items}
        frame = await self._recv_one(None if out is None else [None if i in places else o for i, o in enumerate(out)])
        tensors = list(frame.tensors)
        size = sum(n for *_, n in items) + sum(buffer_nbytes(t) for t in tensors)
        if size > self.config.max_frame_bytes:
            raise FrameError(f"frame of {size} bytes exceeds max_frame_bytes={self.config.max_frame_bytes}")
        device = self._receive_device()
        dests = []
        for i, dtype, shape, n in items:
            if i >= len(tensors) or buffer_nbytes(tensors[i]):
                raise FrameError(f"UCX notice names buffer {i}, which the frame does not leave empty")
            dest = out[i] if out is not None and i < len(out) else None
            if dest is None:
                dest = torch.empty(shape, dtype=dtype, device=device)
            elif not (isinstance(dest, torch.Tensor) and dest.is_contiguous() and dest.nbytes == n):
                raise FrameError(f"out buffer {i} is not a contiguous tensor of the {n} bytes the frame carries")
            dests.append((i, dest, n))
        # UCX writes them outside the streams' order: a block the caching allocator just
        # handed out (or an `out` tensor) may still be read by kernels queued on the current
        # stream, so the payloads are received once those have run.
        await _current_streams_done([dest for _, dest, _ in dests])
        for i, dest, n in dests:
            if n:
                await self._read_exact(_bytes_of(dest))
            tensors[i] = dest
        return Frame(frame.kind, frame.header, tensors)

    async def _recv_one(self, out) -> Frame:
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
        except BaseException as exc:
            self._orphans.append(view)  # UCX may still write into it (see __init__)
            if isinstance(exc, TransportError) or not isinstance(exc, Exception):  # a cancellation too
                raise
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
            return ("ucxx is not installed (pip install 'lamina[ucx]', i.e. ucxx-cu12; 'lamina[ucx-cu13]' beside a "
                    "CUDA 13 torch)")
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
