"""GPU tensors between processes on one host (``cuda_ipc://name``).

A connection is an ``shm://name`` connection (its socket, peer-uid check, token
handshake, and frames of host memory through its rings) plus, for each direction, a
ring of device memory that both processes map once when they connect: the sender's
buffer, exported with a CUDA IPC handle (allocated outside expandable segments, which
CUDA IPC cannot export between unrelated processes). No handle travels per frame.

Sending a frame, its CUDA tensors are copied into the sender's ring on the connection's
copy stream, after whatever the sender's current stream queued before (a caller
computing on another stream makes the current one wait for it first). What comes next
is the sender's choice (``TransportConfig.cuda_ipc_device_order``; the receiver reads
both kinds of frame):

- host-ordered (the default): the sender waits until those copies are done (polling
  their event, as the event loop's other tasks run) and only then sends the frame
  through shm, with each CUDA tensor's place in the ring (offset, dtype, shape) in place
  of its bytes. The receiver so reads finished bytes: its streams never wait on the
  sender's (one slow peer cannot hold back the receiver's other work, and a peer that
  dies leaves nothing to wait on); the price is that the frame's trip through shm (a 4
  KiB round trip takes about 14 us here) and the receiver's launches follow the
  sender's GPU work instead of overlapping it.
- device-ordered: the sender records one of its interprocess CUDA events after the
  copies (a pool of them per connection, exported with the ring at connect) and sends
  the frame at once, naming the event; the receiver's copy-out stream waits for that
  event on the device before copying. Neither host waits for a GPU on the frame's way,
  so each side launches its next work while the other's still runs; the sender's
  current stream waits for the copies on the device (a write into a sent tensor queued
  there comes after them). An event is recorded again only after the receiver has freed
  the frame that last used it (so its wait was queued on that record), and a closed
  connection's events are destroyed only when every frame naming them was freed.
  What a wait on the event of a peer that dies before its copies ran does is the
  driver's (bench/gpu_handoff.py's `event_exit` measures it): closing such a connection
  waits a bounded time for its copies, then logs that its streams may be stuck and keeps
  the rings and events mapped. Where the driver ends such a wait, the frame was read
  before it was written: each device-ordered frame carries a seal, written into the ring
  after its tensors and read back to the receiver's host with them (`_Seals`), and
  `torn_frames()` counts the frames whose seal was not theirs (the model worker fails
  the steps in flight when one is found).

The receiver copies each tensor out into a new one on its current device, on a stream of
the connection, and hands the frame on at once: `recv` makes the caller's current stream
wait for those copies (on the device: the receiving end's host never waits for its GPU
on a frame's way in) and has the allocator keep their memory for that stream, so a
caller computing on another stream makes it wait for the current one, as for any tensor
made there. Once the copies are done, a task of the connection tells the sender that
ring space (and the frames' events) are free again (a small frame of its own), so a
sender reuses space only after the copies out of it finished.
CPU tensors and byte buffers travel through shm as on ``shm://``. A frame whose CUDA
tensors do not fit the ring at once travels through host memory whole (copied to the
CPU and back), slower but the same frame.

Frames keep their semantics: order, kinds, headers (any msgpack value), timeouts, the
``max_frame_bytes`` bound over every byte of a frame, and a closed or vanished peer
(PeerClosed). Each connection owns two tasks: one reads the shm connection (it takes the
receiver's space-free frames at once, whether or not the caller is receiving, and queues
at most ``_QUEUED`` data frames ahead of the caller), the other sends this end's
space-free frames as its copies out finish. The space-free frames for this end's ring
come behind the peer's data frames, so an end that sends CUDA tensors without ever
receiving can wait for ring space once the peer has sent it more than ``_QUEUED``
frames (the services always read their connections).

Two ends in one process (a test, or services sharing a process) share the ring object
and events themselves: a process cannot open its own CUDA IPC handles. The peer's GPU is
named by its UUID, so processes that see the GPUs under other indices
(CUDA_VISIBLE_DEVICES) agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import uuid
import weakref
from collections import deque
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
# Interprocess events a device-ordered sender records in turn: at most this many of its
# frames are out before the receiver frees the oldest (the reader queues only _QUEUED).
_EVENTS = 32
# Seconds a closing end waits for its copies where either end orders frames on the device
# (they may wait on the peer's events) before it reports them stuck.
_CLOSE_WAIT_S = 10.0
# Seconds a closing device-ordered sender waits for the peer to free its last frames (else
# its events are kept for the process's life).
_FREE_WAIT_S = 1.0
_EMPTY = torch.empty(0, dtype=torch.uint8)  # what stands in a frame for a tensor that is in the ring
# This process's rings by token, for a peer in the same process.
_LOCAL: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
_SEAL_BYTES = 8  # a device-ordered frame's seal in the ring: one int64 after its tensors
_SEAL_MASK = (1 << 62) - 1
# What closed connections left that a queued wait may still refer to, kept for the
# process's life (the driver leaves a wait on a destroyed IPC event undefined): event pools
# whose frames the peer did not all free, rings, events and streams whose copies did not
# finish.
_STUCK: list[Any] = []
# With the pid, what tells this process from another (pids repeat across pid namespaces;
# a child forked after this import shares this value, but not the pid).
_PROCESS = uuid.uuid4().hex


def _ipc_exportable(nbytes: int, device: torch.device) -> torch.Tensor:
    """Device memory that CUDA IPC can export: where the allocator hands out expandable
    segments (PYTORCH_CUDA_ALLOC_CONF), those are off for this one allocation."""
    conf = ",".join(os.environ.get(name, "") for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    expandable = "expandable_segments:true" in conf.replace(" ", "").lower()
    if expandable:
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    try:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    finally:
        if expandable:
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _local_device(desc: dict[str, Any]) -> torch.device:
    """This process's index of the GPU the peer's ring is on (named by its UUID)."""
    for index in range(torch.cuda.device_count()):
        if _device_uuid(index) == desc["device_uuid"]:
            return torch.device("cuda", index)
    raise TransportError(f"cuda_ipc: the peer's ring is on GPU {desc['device_uuid']}, which this process does not "
                         "see (CUDA_VISIBLE_DEVICES?)")


class _Exported:
    """A direction's ring, as the sending end holds it (kept alive by it)."""

    def __init__(self, device: torch.device, nbytes: int, device_order: bool) -> None:
        self.ring = _ipc_exportable(nbytes, device)
        self.token = uuid.uuid4().hex
        # Device-ordered sends: the events this end records after a frame's copies, and
        # what its seals start from (random: no tensor's bytes are likely to equal one).
        self.events: list[torch.cuda.Event] = _event_pool(device) if device_order else []
        self.salt = secrets.randbits(62) if device_order else 0

    def describe(self) -> dict[str, Any]:
        """What the peer needs to map this ring and its events (plain values, for msgpack)."""
        storage = self.ring.untyped_storage()
        return {"pid": os.getpid(), "process": _PROCESS, "token": self.token,
                "device_uuid": _device_uuid(self.ring.device.index), "ring": list(storage._share_cuda_()),
                "events": [bytes(e.ipc_handle()) for e in self.events], "salt": self.salt}


def _event_pool(device: torch.device) -> list[torch.cuda.Event]:
    """_EVENTS new interprocess events on `device` (a connection's own: a pool is never
    handed to another connection, whose peer might then open the same handles twice)."""
    stream = torch.cuda.current_stream(device)
    pool = [torch.cuda.Event(interprocess=True) for _ in range(_EVENTS)]
    for event in pool:
        event.record(stream)  # made now, on the stream's device (torch makes an event at its first use)
    return pool


def _mapped_events(desc: dict[str, Any]) -> list[torch.cuda.Event]:
    """The peer's interprocess events (none: it sends host-ordered), opened in this process."""
    handles = desc.get("events") or []
    if not isinstance(handles, list) or not all(isinstance(h, bytes) for h in handles):
        raise TransportError("cuda_ipc: the peer's events are not IPC handles")
    if not handles:
        return []
    if desc["pid"] == os.getpid() and desc["process"] == _PROCESS:
        exported = _LOCAL.get(desc["token"])
        if exported is None:
            raise TransportError("cuda_ipc: the peer's events are gone (same process)")
        return list(exported.events)
    device = _local_device(desc)
    return [torch.cuda.Event.from_ipc_handle(device, h) for h in handles]


def _mapped(desc: dict[str, Any]) -> torch.Tensor:
    """The peer's ring, mapped in this process."""
    handle = desc["ring"]  # _share_cuda_()'s: device, handle, size, offset, ref counter (2), event (2)
    if desc["pid"] == os.getpid() and desc["process"] == _PROCESS:
        exported = _LOCAL.get(desc["token"])
        if exported is None:
            raise TransportError("the peer's ring is gone (same process)")
        # Exporting counted one user of the ring that no _new_shared_cuda will count off:
        # without this the freed ring would wait in torch's limbo for good.
        torch.UntypedStorage._release_ipc_counter_cuda(handle[4], handle[5])
        return exported.ring
    device = _local_device(desc)
    # Opened on this process's index of the peer's GPU (the handle carries the peer's).
    storage = torch.UntypedStorage._new_shared_cuda(device.index, *handle[1:])
    ring = torch.empty(0, dtype=torch.uint8, device=device)
    ring.set_(storage, 0, (storage.nbytes(),), (1,))
    return ring


def _aligned(nbytes: int) -> int:
    """The ring bytes a buffer of `nbytes` takes (each starts at a multiple of _ALIGN)."""
    return -(-nbytes // _ALIGN) * _ALIGN


def _span(sizes: Sequence[int]) -> int:
    """The ring bytes a frame of buffers of these sizes takes, one after another."""
    return sum(map(_aligned, sizes))


def seal_of(salt: int, number: int) -> int:
    """What a device-ordered sender writes after frame `number`'s tensors in its ring."""
    return (salt + number) & _SEAL_MASK


class _Seals:
    """A receiving end's check of its device-ordered frames. A sender writes a seal into
    its ring after a frame's tensors (`seal_of` its frame number), before the event the
    receiver's copies out wait for; the receiver copies the seal to pinned host memory
    with the tensors. Once those copies are done the seal must be the frame's: a frame
    whose wait ended although its sender never ran its copies (a sender that vanished,
    where the driver then ends the waits on its events) reads an older value, and is
    counted torn. Kept (in `_TALLY`) until every frame is checked, past the connection's
    end: a caller may hold a frame of a connection that is gone."""

    def __init__(self, slots: int, salt: int, peer: str) -> None:
        self.copies = torch.empty(slots, dtype=torch.int64, pin_memory=True)  # by event index
        self.salt = salt
        self.peer = peer
        self.pending: deque[tuple[torch.cuda.Event, int, int]] = deque()  # (copies done, slot, seal)
        self.ended = False

    def expect(self, done: torch.cuda.Event, slot: int, number: int) -> None:
        self.pending.append((done, slot, seal_of(self.salt, number)))

    def check(self) -> int:
        """Checks the frames whose copies are done (in order: one stream copies them);
        how many of them were torn."""
        torn = 0
        while self.pending and self.pending[0][0].query():
            _, slot, expected = self.pending.popleft()
            if int(self.copies[slot]) != expected:
                torn += 1
                log.error("cuda_ipc: a frame from %s was read before its sender wrote it whole (the sender "
                          "vanished?)", self.peer)
        return torn


class _Tally:
    """This process's receiving ends' seals and the torn frames found in them."""

    def __init__(self) -> None:
        self.torn = 0
        self.seals: list[_Seals] = []

    def check(self, seals: _Seals) -> None:
        self.torn += seals.check()
        if seals.ended and not seals.pending and seals in self.seals:
            self.seals.remove(seals)  # its connection is closed and its last frame checked


_TALLY = _Tally()


def torn_frames() -> int:
    """Device-ordered frames this process received that were torn (read before their
    sender wrote them whole), counted so far: every frame whose copies out are done is
    checked first. A caller that read frames compares the count before and after (after
    its GPU work on them is done) to know whether one of its frames was torn."""
    for seals in list(_TALLY.seals):
        _TALLY.check(seals)
    return _TALLY.torn


class _Space:
    """The sending end's view of its ring: bytes handed out (`head`) and given back by the
    receiver (`freed`), and frames through the ring sent (`frames`) and freed
    (`frames_freed`), all counted since the connection opened, and a wait for space.
    `max_frames` (0: no bound): how many frames may be out at once (a device-ordered
    sender's events)."""

    def __init__(self, nbytes: int, max_frames: int = 0) -> None:
        self.size = nbytes
        self.head = 0
        self.freed = 0
        self.frames = 0
        self.frames_freed = 0
        self.max_frames = max_frames
        self._more = asyncio.Event()
        self._failed: TransportError | None = None

    def free(self, upto: int, frames: int = 0) -> None:
        if upto > self.freed or frames > self.frames_freed:
            self.freed = max(self.freed, upto)
            self.frames_freed = max(self.frames_freed, frames)
            self._more.set()

    async def drained(self) -> None:
        """Returns once the receiver freed every frame taken (waits as long as it takes)."""
        while self.frames_freed < self.frames:
            self._more.clear()
            await self._more.wait()

    def fail(self, exc: TransportError) -> None:
        """No more space will be freed (the connection ended): waiting senders raise exc."""
        self._failed = exc
        self._more.set()

    async def take(self, sizes: Sequence[int]) -> list[int]:
        """Ring offsets for tensors of these byte sizes, one run of contiguous space (a run
        that would wrap starts over at the ring's start, skipping the rest), for frame
        number `frames` (counted up by one); waits for the receiver to free enough, and
        under `max_frames` for it to free the frame that many before this one."""
        need = _span(sizes)
        while True:
            if self._failed is not None:
                raise self._failed
            at = self.head % self.size
            skip = 0 if at + need <= self.size else self.size - at
            # The skipped end is never written: once everything before it is freed, so is it.
            freed = self.freed + skip if self.freed >= self.head else self.freed
            frame_free = not self.max_frames or self.frames - self.frames_freed < self.max_frames
            if self.head + skip + need - freed <= self.size and frame_free:
                break
            self._more.clear()
            await self._more.wait()
        start = (self.head + skip) % self.size
        offsets, pos = [], start
        for n in sizes:
            offsets.append(pos)
            pos += _aligned(n)
        self.head += skip + need
        self.frames += 1
        return offsets


class CudaIpcConnection(Connection):
    stages_cuda = False  # its rings of device memory carry CUDA tensors

    def __init__(self, inner: Connection, config: TransportConfig, exported: _Exported,
                 peer_ring: torch.Tensor, peer_events: list[torch.cuda.Event], peer_salt: int = 0) -> None:
        super().__init__(config)
        self._inner = inner
        self._out = exported
        self._space = _Space(exported.ring.numel(), max_frames=len(exported.events))
        self._peer_ring = peer_ring
        # The peer's events (empty: it sends host-ordered), which its frames name.
        self._peer_events = peer_events
        self._received = 0  # frames through the peer's ring unpacked: what a space-free frame counts
        self._sealed = 0  # device-ordered frames sealed (their seals' numbers)
        self._seals: _Seals | None = None
        if peer_events:
            self._seals = _Seals(len(peer_events), peer_salt, inner.peer)
            _TALLY.seals.append(self._seals)
        self._device = exported.ring.device
        # The ring's copies run here, after the sender's current stream.
        self._copy = torch.cuda.Stream(self._device)
        # The copies out of the peer's ring run here (the reader's, whatever stream the
        # caller computes on when it runs); the caller's stream waits for a frame's at recv.
        self._copy_out = torch.cuda.Stream(self._device)
        # Received frames, each with the event of its copies out (None: it had none).
        self._frames: asyncio.Queue[tuple[Frame, torch.cuda.Event | None] | TransportError] = asyncio.Queue(_QUEUED)
        # Copies out of the peer's ring still running, in order, with the ring position
        # and the count of frames that each frees (unbounded: the sender's ring bounds
        # what can be in flight).
        self._copying: asyncio.Queue[tuple[torch.cuda.Event, int, int]] = asyncio.Queue()
        self._ended = asyncio.Event()  # set by close()
        loop = asyncio.get_running_loop()
        self._pump = loop.create_task(self._read())
        self._freer = loop.create_task(self._free())

    @classmethod
    async def open(cls, inner: Connection, config: TransportConfig, is_client: bool) -> CudaIpcConnection:
        """Each end exports its ring and maps the peer's (the client speaks first)."""
        try:
            try:
                device = torch.device("cuda", torch.cuda.current_device())
                exported = _Exported(device, config.cuda_ipc_ring_bytes, config.cuda_ipc_device_order)
                _LOCAL[exported.token] = exported
                mine = Frame(0, [_SETUP, exported.describe()])
            except (RuntimeError, AttributeError) as exc:  # out of memory, or a ring CUDA IPC cannot export
                raise TransportError(f"cuda_ipc: cannot export a ring here: {exc}") from exc
            if is_client:
                await inner.send(mine)
            theirs = await inner.recv(timeout=config.handshake_timeout)
            if not is_client:
                await inner.send(mine)
            if not (isinstance(theirs.header, list) and theirs.header[:1] == [_SETUP]
                    and isinstance(theirs.header[1], dict)):
                raise FrameError("cuda_ipc: the peer's first frame is not its ring (an shm:// peer?)")
            try:
                ring = _mapped(theirs.header[1])
                events = _mapped_events(theirs.header[1])
                salt = int(theirs.header[1].get("salt", 0))
            except (RuntimeError, KeyError, TypeError) as exc:
                raise TransportError(f"cuda_ipc: cannot map the peer's ring: {exc!r}") from exc
        except BaseException:
            await inner.close()
            raise
        return cls(inner, config, exported, ring, events, salt)

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
        events = self._out.events
        seal = [_SEAL_BYTES] if events else []  # a device-ordered frame's seal after its tensors
        sizes = [buffer_nbytes(t) for t in gpu.values()] + seal
        fits = _span(sizes) <= self._space.size
        if gpu and not fits:
            for i, t in gpu.items():  # too big for the ring at once: through host memory, whole
                tensors[i] = t.cpu()
            through_host = on_gpu
        elif gpu:
            head, number = self._space.head, self._space.frames
            offsets = await self._space.take(sizes)
            try:
                self._into_ring(gpu, offsets, places, tensors)
                if events:  # device-ordered: the receiver's stream waits for this record
                    event = number % len(events)
                    at = offsets[-1]
                    # Where the seal is, and whose: a count never rewound (a failed send's
                    # seal may be in the ring; the next frame's must not equal it).
                    self._sealed += 1
                    ordered = [event, [at, self._sealed]]
                    with torch.cuda.stream(self._copy):  # written last: the frame is whole once it is
                        self._out.ring[at:at + _SEAL_BYTES].view(torch.int64).fill_(
                            seal_of(self._out.salt, self._sealed))
                    events[event].record(self._copy)
                    # The send returns before the copies ran: what the caller's stream
                    # queues next (a write into a sent tensor) comes after them.
                    torch.cuda.current_stream(self._device).wait_stream(self._copy)
                else:
                    ordered = []
                    copied = torch.cuda.Event()
                    copied.record(self._copy)
                    await until_done(copied)  # the receiver reads finished bytes (see the module's docstring)
                await self._inner.send(Frame(frame.kind, [_DATA, frame.header, places, self._space.head, [],
                                                          *ordered], tensors))
            except BaseException:
                # Never sent: its space (and event) are this end's again (sends are one at
                # a time, and the next frame's copies queue behind these on the copy stream).
                self._space.head, self._space.frames = head, number
                raise
            return
        await self._inner.send(Frame(frame.kind, [_DATA, frame.header, places, self._space.head, through_host],
                                     tensors))

    def _into_ring(self, gpu: dict[int, torch.Tensor], offsets: list[int], places: list[list[Any]],
                   tensors: list[Buffer]) -> None:
        """Queues the copies of a frame's CUDA tensors into this end's ring at `offsets`, on
        the copy stream after the current one (the tensors are made there), and puts each
        one's place in `places` and an empty stand-in in `tensors`."""
        ring = self._out.ring
        copy = self._copy
        copy.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(copy):
            for (i, t), at in zip(gpu.items(), offsets):
                n = buffer_nbytes(t)
                if n:
                    src = t.detach().resolve_conj().resolve_neg().contiguous()
                    ring[at:at + n].copy_(src.reshape(-1).view(torch.uint8), non_blocking=True)
                    t.record_stream(copy)
                places.append([i, at, n, str(t.dtype).removeprefix("torch."), list(t.shape)])
                tensors[i] = _EMPTY

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
                    self._space.free(int(body[1]), int(body[2]) if len(body) > 2 else 0)
                    continue
                await self._frames.put(self._unpack(frame.kind, body, frame.tensors))
        except TransportError as exc:
            error = exc
        except Exception as exc:
            log.exception("cuda_ipc reader of %s failed", self.peer)
            error = TransportError(f"cuda_ipc reader failed: {exc!r}")
        # The caller's recv raises it once it took the frames before it.
        self._space.fail(PeerClosed(f"connection to {self.peer} ended: {error}"))
        await self._frames.put(error)

    def _unpack(self, kind: int, body: list, tensors: list[Buffer]) -> tuple[Frame, torch.cuda.Event | None]:
        """A data frame with its CUDA tensors' copies queued on the copy-out stream, and
        the event recorded after them (the ring's places also queued for `_free`)."""
        try:  # five items host-ordered, seven device-ordered (the event and the seal)
            _, header, places, upto, through_host, event, sealed = body if len(body) != 5 else [*body, None, None]
        except ValueError:
            raise FrameError("cuda_ipc: malformed header") from None
        if not (places or through_host):
            return Frame(kind, header, tensors), None
        tensors = list(tensors)
        ring = self._peer_ring
        if event is not None:
            if not (places and isinstance(event, int) and 0 <= event < len(self._peer_events)):
                raise FrameError(f"cuda_ipc: a frame names event {event!r} of the peer's {len(self._peer_events)}")
            if not (isinstance(sealed, list) and len(sealed) == 2 and all(isinstance(x, int) for x in sealed)
                    and sealed[0] % _SEAL_BYTES == 0 and 0 <= sealed[0] <= ring.numel() - _SEAL_BYTES):
                raise FrameError(f"cuda_ipc: a frame's seal {sealed!r} is not in the ring")
            # Device-ordered: the copies out wait on the device for the sender's into the ring.
            self._copy_out.wait_event(self._peer_events[event])
        # Allocated and written on the copy-out stream: the caller's stream is made to wait
        # for it, and to keep the memory, at recv.
        with torch.cuda.stream(self._copy_out):
            for i, at, n, dtype_name, shape in places:
                dtype = DTYPES.get(dtype_name)
                if (dtype is None or not 0 <= i < len(tensors) or not 0 <= at <= at + n <= ring.numel()
                        or math.prod(shape) * torch.empty((), dtype=dtype).element_size() != n):
                    raise FrameError(f"cuda_ipc: a tensor's place {[i, at, n, dtype_name, shape]} does not fit")
                out = torch.empty(shape, dtype=dtype, device=self._device)
                if n:
                    out.reshape(-1).view(torch.uint8).copy_(ring[at:at + n], non_blocking=True)
                tensors[i] = out
            for i in through_host:
                moved = tensors[i]
                if not isinstance(moved, torch.Tensor):
                    raise FrameError("cuda_ipc: a buffer sent through host memory is not a tensor")
                tensors[i] = moved.to(self._device)
            # A device-ordered frame's seal (its event names one of the peer's, so it has seals).
            seals = self._seals if event is not None else None
            if seals is not None:
                seal_at = sealed[0]
                seals.copies[event:event + 1].copy_(ring[seal_at:seal_at + _SEAL_BYTES].view(torch.int64),
                                                    non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._copy_out)
        if seals is not None:
            seals.expect(done, event, sealed[1])
        if places:
            self._received += 1
            self._copying.put_nowait((done, int(upto), self._received))
        return Frame(kind, header, tensors), done

    async def _free(self) -> None:
        """Gives the peer its ring space back as the copies out of it finish, in order."""
        try:
            while True:
                done, upto, frames = await self._copying.get()
                await until_done(done, clock=None)  # off the senders' path: not a device wait of theirs
                if self._seals is not None:  # before the seals' slots may be used again
                    _TALLY.check(self._seals)
                await self._inner.send(Frame(0, [_FREE, upto, frames]))
        except TransportError:
            pass  # the connection ended: the reader reports it to the caller
        except Exception:  # a failed copy: the sender would wait for its space forever
            log.exception("cuda_ipc: freeing ring space for %s failed; closing the connection", self.peer)
            await self._inner.close()

    async def _recv_frame(self, out) -> Frame:
        got = await self._frames.get()
        if isinstance(got, BaseException):
            self._frames.put_nowait(got)  # every later recv says the same
            raise got
        item, copied = got
        if copied is not None:
            # The caller's current stream reads the copies after they are done, on the
            # device (the host does not wait), and the allocator keeps their memory for it.
            current = torch.cuda.current_stream(self._device)
            current.wait_event(copied)
            for t in item.tensors:
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(current)
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
        # From here no send takes ring space or an event.
        self._space.fail(PeerClosed(f"connection to {self.peer} is closed"))
        finished = False
        try:
            if self._out.events:
                await self._peer_freed()
            for task in (self._pump, self._freer):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            # Copies still queued into this end's ring, or out of the peer's, finish before
            # the peer may unmap it or this end drops its mapping.
            finished = await self._copies_done()
        finally:
            await self._inner.close()
            _LOCAL.pop(self._out.token, None)
            # The events are destroyed with this end only once the peer freed every frame
            # that named them (its waits on them were queued and are over); else they are
            # kept, never recorded again nor destroyed.
            if not (finished and self._space.frames_freed >= self._space.frames) and self._out.events:
                _STUCK.append(self._out.events)
            if self._seals is not None:
                self._seals.ended = True  # checked on until its last frame is
                _TALLY.check(self._seals)
            self._ended.set()

    async def wait_closed(self) -> None:
        await self._ended.wait()

    async def _copies_done(self) -> bool:
        """Waits for the copies into this end's ring and out of the peer's; whether they
        finished. Where either end orders frames on the device, these copies may wait on
        the peer's events (the copies out directly, the copies in through the caller's
        stream, which waited for received frames), which a peer that died before its
        copies ran may never complete: the wait ends after _CLOSE_WAIT_S with a report,
        and both rings, the events and the streams stay mapped (freeing what a queued
        wait refers to is undefined)."""
        if not (self._peer_events or self._out.events):
            self._copy.synchronize()
            self._copy_out.synchronize()
            return True
        marks = []
        for stream in (self._copy, self._copy_out):
            mark = torch.cuda.Event()
            mark.record(stream)
            marks.append(mark)

        async def both() -> None:
            for mark in marks:
                await until_done(mark, clock=None)
        left = (self._out, self._peer_ring, self._peer_events, self._copy, self._copy_out)
        try:
            await asyncio.wait_for(both(), _CLOSE_WAIT_S)
        except TimeoutError:
            log.error("cuda_ipc: copies into this end's ring or out of %s's still wait %.0f s after the "
                      "connection ended (the peer died before its copies ran?); this process's streams that "
                      "waited for them, and any stream torch hands out again later, may not run: restart "
                      "it", self.peer, _CLOSE_WAIT_S)
            _STUCK.append(left)
            return False
        except BaseException:  # the close itself cancelled: what the copies use is kept all the same
            _STUCK.append(left)
            raise
        return True

    async def _peer_freed(self) -> None:
        """Waits briefly (the reader still taking space-free frames) until the peer freed
        every frame this end sent through its ring: then each wait of the peer's on this
        end's events is over, and they may be destroyed with it."""
        if not self._pump.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._space.drained(), _FREE_WAIT_S)


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
        if torch.cuda.get_allocator_backend() == "cudaMallocAsync":
            return ("torch's cudaMallocAsync allocator (PYTORCH_CUDA_ALLOC_CONF backend) cannot export memory by "
                    "CUDA IPC handle")
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
