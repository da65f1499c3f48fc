"""The scheduler's side of the decode streams, one per model worker.

Each stream is a bidirectional gRPC call: batch changes go out (sequences joining
with their whole state, sequences leaving), step results come back. Nothing is
sent per step, so a step costs the control plane only its results.

Ownership: a ModelStream owns its call and the task reading it; `close()` ends the
call and awaits the task. `on_result(worker, result)` is awaited for every result
in order; `on_lost(worker, error)` once, when the stream fails.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from lamina.services.protos import lamina_pb2, lamina_pb2_grpc

log = logging.getLogger(__name__)

OnResult = Callable[[int, lamina_pb2.DecodeResult], Awaitable[None]]
OnLost = Callable[[int, str], Awaitable[None]]


class ModelStream:
    def __init__(self, index: int, stub: lamina_pb2_grpc.ModelWorkerStub, stop: lamina_pb2.StopRule,
                 on_result: OnResult, on_lost: OnLost) -> None:
        self.index = index
        self._stub = stub
        self._on_result = on_result
        self._on_lost = on_lost
        self._updates: asyncio.Queue[lamina_pb2.DecodeUpdate | None] = asyncio.Queue()
        self._updates.put_nowait(lamina_pb2.DecodeUpdate(stop=stop))
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task | None = None
        self.num_sequences = 0  # joined and not yet released: the scheduler's load figure
        self.alive = True  # false once the stream failed (the scheduler opens a new one)
        # When the worker last showed progress (a result), or got work while idle: a
        # worker holding sequences that shows none for a while is hung (stalled_for).
        self._progress_at = time.monotonic()

    def open(self) -> None:
        call = self._call = self._stub.Decode(self._outgoing())
        self._reader = asyncio.create_task(self._read(call), name=f"decode-stream-{self.index}")

    async def _outgoing(self) -> AsyncIterator[lamina_pb2.DecodeUpdate]:
        while True:
            update = await self._updates.get()
            if update is None:
                return
            yield update

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        try:
            while True:
                result = await call.read()
                if result is grpc.aio.EOF:
                    await self._on_lost(self.index, "the model worker ended its decode stream")
                    return
                self._progress_at = time.monotonic()
                await self._on_result(self.index, result)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            await self._on_lost(self.index, exc.details() or exc.code().name)
        except Exception as exc:  # requests must end, not wait on a dead reader
            log.exception("decode stream %d: handling a result failed", self.index)
            call.cancel()
            await self._on_lost(self.index, f"{type(exc).__name__}: {exc}")

    def join(self, seqs: list[lamina_pb2.StepSequence]) -> None:
        if not self.num_sequences:
            self._progress_at = time.monotonic()
        self.num_sequences += len(seqs)
        self._updates.put_nowait(lamina_pb2.DecodeUpdate(joins=seqs))

    def leave(self, seq_ids: list[str]) -> None:
        self._updates.put_nowait(lamina_pb2.DecodeUpdate(leaves=seq_ids))

    def stalled_for(self, now: float) -> float:
        """Seconds the worker has held sequences without a result (0 when it holds none)."""
        return now - self._progress_at if self.num_sequences > 0 else 0.0

    def released(self, count: int = 1) -> None:
        self.num_sequences -= count

    async def close(self) -> None:
        self._updates.put_nowait(None)
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._call is not None:
            self._call.cancel()
