"""GPU tensors between processes on one host (``cuda_ipc://name``).

A connection is an ``shm://name`` connection (its socket, peer-uid check, token
handshake, and frames of host memory through its rings) plus, for each direction, a
ring of device memory that both processes map once when they connect: the sender's
buffer, exported with a CUDA IPC handle, and an interprocess CUDA event the sender
records. No handle travels per frame.

Sending a frame, its CUDA tensors are copied into the sender's ring on the connection's
copy stream, after whatever the sender's current stream queued before (a caller
computing on another stream makes the current one wait for it first); the event is
recorded there (one stream: its latest record covers every earlier frame's copies), and
the frame goes through shm with each CUDA tensor's place in the ring (offset, dtype,
shape) in place of its bytes. The receiver copies each one out into a new tensor on its
current device, on its current stream, after the sender's event; once those copies are
done it hands the frame on and tells the sender that ring space is free again (a small
frame of its own), so a sender reuses space only after the copies out of it finished.
CPU tensors and byte buffers travel through shm as on ``shm://``. A frame whose CUDA
tensors do not fit the ring at once travels through host memory whole (copied to the
CPU and back), slower but the same frame.

Frames keep their semantics: order, kinds, headers (any msgpack value), timeouts, the
``max_frame_bytes`` bound over every byte of a frame, and a closed or vanished peer
(PeerClosed). Each connection owns one task that reads the shm connection: it takes the
receiver's space-free frames at once, whether or not the caller is receiving, and queues
at most ``_QUEUED`` data frames ahead of the caller.

Two ends in one process (a test, or services sharing a process) share the ring and the
event objects themselves: a process cannot open its own CUDA IPC handles.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import uuid
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from .base import Connection, Handler, Listener, Transport, split_address
from .config import TransportConfig
from .errors import FrameError, PeerClosed, TransportError
from .frame import DTYPES, Buffer, Frame, buffer_nbytes
from .host_staging import until_done
from .shm import ShmTransport

log = logging.getLogger(__name__)

_ALIGN = 256  # each tensor starts at a multiple of this in the ring (any dtype's alignment)
# Data frames read ahead of the caller: a few, so that a receiver that stops reading
# still holds back its sender (as a full shm ring does) and few copies wait in device memory.
_QUEUED = 4
_SETUP, _DATA, _FREE = 0, 1, 2  # the inner header's first item
_EMPTY = torch.empty(0, dtype=torch.uint8)  # what stands in a frame for a tensor that is in the ring
# This process's rings and events by token, for a peer in the same process.
_LOCAL: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


class _Exported:
    """A direction's ring and event, as the sending end holds them (kept alive by it)."""

    def __init__(self, device: torch.device, nbytes: int) -> None:
        self.ring = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.event = torch.cuda.Event(interprocess=True)
        self.token = uuid.uuid4().hex

    def describe(self) -> dict[str, Any]:
        """What the peer needs to map this ring and event (plain values, for msgpack)."""
        storage = self.ring.untyped_storage()
        return {"pid": os.getpid(), "token": self.token, "device": self.ring.device.index,
                "ring": list(storage._share_cuda_()), "event": bytes(self.event.ipc_handle())}


def _mapped(desc: dict[str, Any]) -> tuple[torch.Tensor, torch.cuda.Event]:
    """The peer's ring and event, mapped in this process."""
    if desc["pid"] == os.getpid():
        exported = _LOCAL.get(desc["token"])
        if exported is None:
            raise TransportError("the peer's ring is gone (same process)")
        return exported.ring, exported.event
    device = torch.device("cuda", desc["device"])
    storage = torch.UntypedStorage._new_shared_cuda(*desc["ring"])
    ring = torch.empty(0, dtype=torch.uint8, device=device)
    ring.set_(storage, 0, (storage.nbytes(),), (1,))
    return ring, torch.cuda.Event.from_ipc_handle(device, desc["event"])


class _Space:
    """The sending end's view of its ring: bytes handed out (`head`) and given back by the
    receiver (`freed`), both counted since the connection opened, and a wait for space."""

    def __init__(self, nbytes: int) -> None:
        self.size = nbytes
        self.head = 0
        self.freed = 0
        self._more = asyncio.Event()
        self._failed: TransportError | None = None

    def free(self, upto: int) -> None:
        if upto > self.freed:
            self.freed = upto
            self._more.set()

    def fail(self, exc: TransportError) -> None:
        """No more space will be freed (the connection ended): waiting senders raise exc."""
        self._failed = exc
        self._more.set()

    async def take(self, sizes: Sequence[int]) -> list[int]:
        """Ring offsets for tensors of these byte sizes, one run of contiguous space (a run
        that would wrap starts over at the ring's start, skipping the rest); waits for the
        receiver to free enough."""
        need = sum(-(-n // _ALIGN) * _ALIGN for n in sizes)
        while True:
            if self._failed is not None:
                raise self._failed
            at = self.head % self.size
            skip = 0 if at + need <= self.size else self.size - at
            # The skipped end is never written: once everything before it is freed, so is it.
            freed = self.freed + skip if self.freed >= self.head else self.freed
            if self.head + skip + need - freed <= self.size:
                break
            self._more.clear()
            await self._more.wait()
        start = (self.head + skip) % self.size
        offsets, pos = [], start
        for n in sizes:
            offsets.append(pos)
            pos += -(-n // _ALIGN) * _ALIGN
        self.head += skip + need
        return offsets


class CudaIpcConnection(Connection):
    stages_cuda = False  # its rings of device memory carry CUDA tensors

    def __init__(self, inner: Connection, config: TransportConfig, exported: _Exported, peer_ring: torch.Tensor,
                 peer_event: torch.cuda.Event) -> None:
        super().__init__(config)
        self._inner = inner
        self._out = exported
        self._space = _Space(exported.ring.numel())
        self._peer_ring = peer_ring
        self._peer_event = peer_event
        self._device = exported.ring.device
        # The ring's copies run here, after the sender's current stream: one stream, so the
        # event's latest record covers every earlier frame's copies too.
        self._copy = torch.cuda.Stream(self._device)
        self._frames: asyncio.Queue[Frame | TransportError] = asyncio.Queue(_QUEUED)
        self._ended = asyncio.Event()  # set by close()
        self._pump = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def open(cls, inner: Connection, config: TransportConfig, is_client: bool) -> CudaIpcConnection:
        """Each end exports its ring and event and maps the peer's (the client speaks first)."""
        device = torch.device("cuda", torch.cuda.current_device())
        exported = _Exported(device, config.cuda_ipc_ring_bytes)
        _LOCAL[exported.token] = exported
        mine = Frame(0, [_SETUP, exported.describe()])
        try:
            if is_client:
                await inner.send(mine)
            theirs = await inner.recv(timeout=config.handshake_timeout)
            if not is_client:
                await inner.send(mine)
            if not (isinstance(theirs.header, list) and theirs.header[:1] == [_SETUP]):
                raise FrameError("cuda_ipc: the peer's first frame is not its ring (an shm:// peer?)")
            ring, event = _mapped(theirs.header[1])
        except BaseException:
            await inner.close()
            raise
        return cls(inner, config, exported, ring, event)

    @property
    def peer(self) -> str:
        return self._inner.peer

    # -- sending ------------------------------------------------------------------------
    async def _send_frame(self, frame: Frame) -> None:
        tensors = list(frame.tensors)
        gpu = {i: t for i, t in enumerate(tensors) if isinstance(t, torch.Tensor) and t.is_cuda}
        on_gpu = list(gpu)
        host_bytes = sum(buffer_nbytes(t) for i, t in enumerate(tensors) if i not in gpu)
        gpu_bytes = sum(buffer_nbytes(t) for t in gpu.values())
        unsent = [str(t.dtype) for t in gpu.values() if str(t.dtype).removeprefix("torch.") not in DTYPES]
        if unsent:
            raise FrameError(f"cuda_ipc: a frame cannot carry {unsent[0]}")
        if host_bytes + gpu_bytes > self.config.max_frame_bytes:
            raise FrameError(f"frame of {host_bytes + gpu_bytes} bytes exceeds max_frame_bytes "
                             f"({self.config.max_frame_bytes})")
        places: list[list[Any]] = []
        through_host: list[int] = []
        fits = sum(-(-buffer_nbytes(t) // _ALIGN) * _ALIGN for t in gpu.values()) <= self._space.size
        if gpu and not fits:
            for i, t in gpu.items():  # too big for the ring at once: through host memory, whole
                tensors[i] = t.cpu()
            through_host = on_gpu
        elif gpu:
            offsets = await self._space.take([buffer_nbytes(t) for t in gpu.values()])
            ring = self._out.ring
            copy = self._copy
            copy.wait_stream(torch.cuda.current_stream(self._device))  # the tensors are made there
            with torch.cuda.stream(copy):
                for (i, t), at in zip(gpu.items(), offsets):
                    n = buffer_nbytes(t)
                    if n:
                        ring[at:at + n].copy_(t.contiguous().reshape(-1).view(torch.uint8), non_blocking=True)
                        t.record_stream(copy)
                    places.append([i, at, n, str(t.dtype).removeprefix("torch."), list(t.shape)])
                    tensors[i] = _EMPTY
            self._out.event.record(copy)  # after the copies
        await self._inner.send(Frame(frame.kind, [_DATA, frame.header, places, self._space.head, through_host],
                                     tensors))

    # -- receiving ----------------------------------------------------------------------
    async def _read(self) -> None:
        """The connection's one reader of the shm connection: space-free frames are taken
        at once, data frames copied out and queued for `recv`."""
        try:
            while True:
                frame = await self._inner.recv(timeout=None)
                body = frame.header
                if not (isinstance(body, list) and body and body[0] in (_DATA, _FREE)):
                    raise FrameError("cuda_ipc: a frame without its cuda_ipc header")
                if body[0] == _FREE:
                    self._space.free(int(body[1]))
                    continue
                await self._frames.put(await self._unpack(frame.kind, body, frame.tensors))
        except TransportError as exc:
            error = exc
        except Exception as exc:
            log.exception("cuda_ipc reader of %s failed", self.peer)
            error = TransportError(f"cuda_ipc reader failed: {exc!r}")
        # The caller's recv raises it once it took the frames before it.
        self._space.fail(PeerClosed(f"connection to {self.peer} ended: {error}"))
        await self._frames.put(error)

    async def _unpack(self, kind: int, body: list, tensors: list[Buffer]) -> Frame:
        try:
            _, header, places, upto, through_host = body
        except ValueError:
            raise FrameError("cuda_ipc: malformed header") from None
        tensors = list(tensors)
        if places:
            stream = torch.cuda.current_stream(self._device)
            stream.wait_event(self._peer_event)
            ring = self._peer_ring
            for i, at, n, dtype_name, shape in places:
                dtype = DTYPES.get(dtype_name)
                if (dtype is None or not 0 <= i < len(tensors) or not 0 <= at <= at + n <= ring.numel()
                        or math.prod(shape) * torch.empty((), dtype=dtype).element_size() != n):
                    raise FrameError(f"cuda_ipc: a tensor's place {[i, at, n, dtype_name, shape]} does not fit")
                out = torch.empty(shape, dtype=dtype, device=self._device)
                if n:
                    out.reshape(-1).view(torch.uint8).copy_(ring[at:at + n], non_blocking=True)
                tensors[i] = out
            done = torch.cuda.Event()
            done.record(stream)
            await until_done(done)
            await self._inner.send(Frame(0, [_FREE, int(upto)]))
        for i in through_host:
            moved = tensors[i]
            if not isinstance(moved, torch.Tensor):
                raise FrameError("cuda_ipc: a buffer sent through host memory is not a tensor")
            tensors[i] = moved.to(self._device)
        return Frame(kind, header, tensors)

    async def _recv_frame(self, out) -> Frame:
        item = await self._frames.get()
        if isinstance(item, BaseException):
            self._frames.put_nowait(item)  # every later recv says the same
            raise item
        if out:
            for i, dest in enumerate(out[:len(item.tensors)]):
                if dest is not None:
                    item.tensors[i] = _into(dest, item.tensors[i])
        return item

    def _mid_frame(self) -> bool:
        return False  # frames are queued whole: a cancelled recv leaves none half read

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._pump
        await self._inner.close()
        _LOCAL.pop(self._out.token, None)
        self._space.fail(PeerClosed(f"connection to {self.peer} is closed"))
        self._ended.set()

    async def wait_closed(self) -> None:
        await self._ended.wait()


def _into(dest: Buffer, got: Buffer) -> Buffer:
    """A received buffer copied into the caller's destination of the same size."""
    if isinstance(dest, torch.Tensor) and not dest.is_contiguous():
        raise FrameError("out tensors must be contiguous")
    if buffer_nbytes(dest) != buffer_nbytes(got):
        raise FrameError(f"out buffer of {buffer_nbytes(dest)} bytes for a buffer of {buffer_nbytes(got)}")
    if isinstance(dest, torch.Tensor):
        src = got if isinstance(got, torch.Tensor) else torch.frombuffer(bytearray(got), dtype=torch.uint8)
        dest.reshape(-1).view(torch.uint8).copy_(src.reshape(-1).view(torch.uint8))
        return dest
    raw: bytes | bytearray | memoryview = (got.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
                                          if isinstance(got, torch.Tensor) else got)
    memoryview(dest).cast("B")[:] = memoryview(raw).cast("B")
    return dest


def _inner_config(config: TransportConfig) -> TransportConfig:
    """The shm connection's: no timeouts of its own (the reader waits for frames as long as
    the connection lives; the caller's timeouts apply to the cuda_ipc connection)."""
    return config.replace(send_timeout=None, recv_timeout=None)


class CudaIpcListener(Listener):
    """An shm:// listener whose connections become cuda_ipc connections once their rings
    are mapped."""

    def __init__(self, name: str, config: TransportConfig, handler: Handler | None) -> None:
        super().__init__(config, handler)
        self._address = f"cuda_ipc://{name}"
        self._inner: Listener | None = None

    async def start(self, name: str) -> None:
        self._inner = await ShmTransport().listen(f"shm://{name}", self._opened, _inner_config(self.config))

    async def _opened(self, inner: Connection) -> None:
        try:
            conn = await CudaIpcConnection.open(inner, self.config, is_client=False)
        except TransportError as exc:
            log.info("cuda_ipc connection from %s refused: %s", inner.peer, exc)
            return
        self._deliver(conn)
        # The shm listener closes `inner` when this returns: the connection's own close
        # (by its handler, or this listener's close) comes first.
        await conn.wait_closed()

    @property
    def address(self) -> str:
        return self._address

    async def _stop_accepting(self) -> None:
        if self._inner is not None:
            await self._inner.close()


class CudaIpcTransport(Transport):
    scheme = "cuda_ipc"

    @classmethod
    def availability(cls) -> str | None:
        shm = ShmTransport.availability()
        if shm is not None:
            return shm
        if not torch.cuda.is_available():
            return "needs a CUDA device (torch finds none here)"
        return None

    async def listen(self, address: str, handler: Handler | None, config: TransportConfig) -> CudaIpcListener:
        name = split_address(address)[1]
        listener = CudaIpcListener(name, config, handler)
        await listener.start(name)
        return listener

    async def connect(self, address: str, config: TransportConfig) -> CudaIpcConnection:
        name = split_address(address)[1]
        inner = await ShmTransport().connect(f"shm://{name}", _inner_config(config))
        try:
            return await CudaIpcConnection.open(inner, config, is_client=True)
        except (OSError, RuntimeError) as exc:
            raise PeerClosed(f"cuda_ipc setup with {address} failed: {exc}") from exc
