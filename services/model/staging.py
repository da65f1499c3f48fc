"""Where a model worker's micro-batches compute on a GPU, and how their Q, K, V reach the
memory that frames carry: host memory, or over cuda_ipc the GPU itself.

Each micro-batch gets a CUDA stream of its own: its slices, its inputs' and its attention
outputs' copies are queued there, so one micro-batch's slice computes while another's
Q, K, V travel to the attention workers and back. Q, K and V are copied into pinned host
buffers on the micro-batch's stream (asynchronous copies; pageable memory would make each
a synchronous one) and the event loop waits for that copy by polling its event between
other tasks' turns, never blocking them as `tensor.cpu()` would. Over cuda_ipc, and
ucx where UCX sends device memory (`device_frames`), they are not copied at all: the
stream that sends them (the thread's current one: cuda_ipc copies them into its ring
there, ucx waits for it before UCX reads them) waits for the micro-batch's. On the CPU
every method hands the tensors back as they are.

The pinned buffers of a micro-batch are reused from layer to layer: a layer's frames are
sent and answered before the micro-batch stages its next layer, so nothing still reads
them then.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from lamina.transports.host_staging import PinnedBuffers, until_done

_NO_STREAM = contextlib.nullcontext()


class Staging:
    """One model worker's streams and pinned buffers, per micro-batch, on `device`."""

    def __init__(self, device: torch.device, device_frames: bool = False) -> None:
        self.device = device
        self.on_gpu = device.type == "cuda"
        self.device_frames = device_frames and self.on_gpu
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._pinned = PinnedBuffers()  # by (micro-batch, tensor index)

    def stream(self, micro_batch: int) -> contextlib.AbstractContextManager[Any]:
        """A context that queues what runs inside on the micro-batch's stream (nothing inside
        may await: the current stream is the thread's). On the CPU one shared no-op context,
        so the CPU's per-slice path pays nothing for it."""
        if not self.on_gpu:
            return _NO_STREAM
        stream = self._streams.get(micro_batch)
        if stream is None:
            stream = self._streams[micro_batch] = torch.cuda.Stream(self.device)
        return torch.cuda.stream(stream)

    async def for_frames(self, micro_batch: int, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors as frames carry them. In pinned host memory, copied on the
        micro-batch's stream after what it queued before (returns once the copies are done,
        letting other tasks run meanwhile); over cuda_ipc as they are, the current stream
        made to wait for the micro-batch's."""
        if not self.on_gpu:
            return [t.cpu() for t in tensors]
        if self.device_frames:
            current = torch.cuda.current_stream(self.device)
            stream = self._streams.get(micro_batch)
            if stream is not None:
                current.wait_stream(stream)
                for t in tensors:
                    t.record_stream(current)  # the send's copy reads them there
            return list(tensors)
        staged = []
        with self.stream(micro_batch):
            for i, t in enumerate(tensors):
                host = self._pinned.like((micro_batch, i), t)
                host.copy_(t, non_blocking=True)
                staged.append(host)
            done = torch.cuda.Event()
            done.record()
        await until_done(done)
        return staged

    def to_device(self, micro_batch: int, t: torch.Tensor) -> torch.Tensor:
        """A frame's tensor on the device for the micro-batch's stream: a host one copied
        there; a device one (cuda_ipc's, perhaps joined with others on the current stream)
        waited for by that stream and kept by the allocator until it is done with it."""
        if not self.on_gpu:
            return t
        if t.is_cuda:
            stream = self._streams.get(micro_batch)
            if stream is not None:
                # Made on the current stream (the receiver's copy, or the pool's joining of
                # several workers' parts): the micro-batch's waits for it.
                stream.wait_stream(torch.cuda.current_stream(self.device))
                t.record_stream(stream)
            return t
        with self.stream(micro_batch):
            return t.to(self.device, non_blocking=True)

    def handed_over(self, micro_batch: int, t: torch.Tensor) -> torch.Tensor:
        """`t`, made on the micro-batch's stream, ready for the thread's current stream (the
        sampler's): that stream waits for the micro-batch's work, and the allocator keeps
        t's memory until that stream is done with it."""
        if self.on_gpu and micro_batch in self._streams:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self._streams[micro_batch])
            t.record_stream(current)
        return t
