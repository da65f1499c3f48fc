"""CUDA tensors in a frame sent over a transport of host memory (tcp, shm, ucx, rdma):
copied into pinned host buffers of the connection on a side stream, and the frame sent
from there once the copies are done, the event loop free meanwhile.

The side stream first waits for the thread's current stream, so a tensor the caller
computed on it is complete before it is copied (a caller computing on another stream
makes the current one wait for it first). The buffers are the connection's, one per
tensor position, grown as needed and reused: a send returns only once its bytes are
handed to the transport, so the next frame's copies never overwrite bytes still to go.
The receiver gets CPU tensors, as from any frame of host memory (cuda_ipc carries device
memory itself and does not stage).
"""

from __future__ import annotations

import asyncio
import time

import torch

from .frame import Frame


def has_cuda(frame: Frame) -> bool:
    """Whether any of the frame's buffers is a CUDA tensor."""
    return any(isinstance(t, torch.Tensor) and t.is_cuda for t in frame.tensors)


class WaitClock:
    """Wall seconds this process's tasks spent waiting for their GPU before sending
    (`until_done`), summed over the tasks: two waiting at once count twice. A service
    reports its increase as a metric (lamina_*_device_wait_seconds_total)."""

    def __init__(self) -> None:
        self.seconds = 0.0


DEVICE_WAITS = WaitClock()


async def until_done(event: torch.cuda.Event, clock: WaitClock | None = DEVICE_WAITS) -> None:
    """Returns once the work recorded before `event` is done, other tasks running
    meanwhile: a CUDA event has no file descriptor to await, so its state is polled
    between their turns (a copy takes tens to hundreds of microseconds). Each poll also
    lets go of the GIL for a moment (`time.sleep(0)`): a loop spinning in Python keeps it
    from the process's other threads for the interpreter's whole switch interval at a
    time, and the prefill worker's forward thread (services/prefill/forward_thread.py)
    needs it for every kernel it launches while its layers' copies are awaited here (on
    two cores, a thread of small torch ops ran at about a fifth of its pace beside a
    uvloop spinning without the release, about half with it: medians of 6 runs of 0.5 s).
    The wait is added to `clock` (None: a wait off the senders' path, not counted)."""
    if event.query():
        return
    t0 = time.perf_counter()
    try:
        while not event.query():
            await asyncio.sleep(0)
            time.sleep(0)  # noqa: ASYNC251 (the GIL released, not a wait)
    finally:
        if clock is not None:
            clock.seconds += time.perf_counter() - t0


class PinnedBuffers:
    """Pinned host memory by key, one byte buffer each, grown as needed and reused."""

    def __init__(self) -> None:
        self._buffers: dict[object, torch.Tensor] = {}

    def like(self, key: object, t: torch.Tensor) -> torch.Tensor:
        """A view of `key`'s buffer with t's dtype and shape (what it held before is gone)."""
        nbytes = t.numel() * t.element_size()
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < nbytes:
            buf = self._buffers[key] = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
        return buf[:nbytes].view(t.dtype).view(t.shape)


class HostStaging:
    """One connection's pinned buffers and copy stream."""

    def __init__(self) -> None:
        self._buffers = PinnedBuffers()  # by tensor position
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    async def stage(self, frame: Frame) -> Frame:
        """The frame with each CUDA tensor replaced by its copy in pinned host memory."""
        tensors = list(frame.tensors)
        events = []
        for i, t in enumerate(tensors):
            if not (isinstance(t, torch.Tensor) and t.is_cuda):
                continue
            stream = self._streams.get(t.device)
            if stream is None:
                stream = self._streams[t.device] = torch.cuda.Stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            host = self._buffers.like(i, t)
            with torch.cuda.stream(stream):
                host.copy_(t, non_blocking=True)
                t.record_stream(stream)
                done = torch.cuda.Event()
                done.record(stream)
            events.append(done)
            tensors[i] = host
        for done in events:
            await until_done(done)
        return Frame(frame.kind, frame.header, tensors)
