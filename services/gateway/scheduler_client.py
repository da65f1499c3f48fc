"""The gateway's backend for the distributed stack: the scheduler over gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from lamina.gateway.backend import BackendError, BackendStats, QueueFullError, RequestRefusedError
from lamina.gateway.protocol import GenerateRequest, TokenEvent
from lamina.services.channels import Channels
from lamina.services.protos import lamina_pb2, lamina_pb2_grpc
from lamina.services.sampling_wire import logprobs_from_proto, params_to_proto


class SchedulerBackend:
    """Implements gateway.backend.Backend. Owns its gRPC channels (`close()`).

    `resolve()` gives the scheduler's current address (its registration): a restarted
    scheduler listens elsewhere, so when the scheduler is unreachable the backend asks
    again and moves to the new address. Requests that were running on a scheduler that
    died end with an error; a request refused as unavailable before it started is sent
    once more, to the new address.

    A scheduler that stops answering (hung, e.g. stopped) without closing its
    connections is noticed by the Stats poll: after `stall_s` without an answer, every
    request in flight ends with an error instead of waiting on it."""

    def __init__(self, address: str, token: str | None = None,
                 resolve: Callable[[], Awaitable[str | None]] | None = None, stall_s: float | None = None) -> None:
        self._stall_s = stall_s
        self._answered_at = time.monotonic()
        self._cut: dict[str, str] = {}  # request id -> why its call was cut
        self._resolve = resolve
        self._address = address
        # The scheduler's channel; one to an address it left is closed after a short grace.
        self._channels = Channels(token)
        self._channel = self._channels.open("scheduler", address)
        self._stub = lamina_pb2_grpc.SchedulerStub(self._channel)
        self._calls: dict[str, grpc.aio.UnaryStreamCall] = {}
        self._stats = BackendStats(0, 0)
        self._stats_task: asyncio.Task | None = None

    async def start(self) -> None:
        self._stats_task = asyncio.create_task(self._poll_stats(), name="scheduler-stats")

    async def close(self) -> None:
        if self._stats_task is not None:
            self._stats_task.cancel()
            await asyncio.gather(self._stats_task, return_exceptions=True)
        await self._channels.close()

    async def _follow(self) -> bool:
        """Move to the scheduler's registered address if it changed; True if it did."""
        if self._resolve is None:
            return False
        try:
            address = await self._resolve()
        except Exception:  # noqa: BLE001 - the metadata store is down too: keep the address
            return False
        if not address or address == self._address:
            return False
        self._address = address
        self._channel = self._channels.open("scheduler", address)
        self._stub = lamina_pb2_grpc.SchedulerStub(self._channel)
        return True

    async def _poll_stats(self) -> None:
        # A periodic refresh for the gauges; stats() must not block.
        while True:
            try:
                s = await self._stub.Stats(lamina_pb2.Empty(), timeout=min(5.0, self._stall_s or 5.0))
                self._stats = BackendStats(s.num_waiting, s.num_running)
                self._answered_at = time.monotonic()
            except grpc.aio.AioRpcError:
                if not await self._follow():  # keep the last figures; the next poll retries
                    self._cut_if_stalled()
            await asyncio.sleep(1.0)

    def _cut_if_stalled(self) -> None:
        silent = time.monotonic() - self._answered_at
        if self._stall_s is None or silent <= self._stall_s:
            return
        for request_id, call in list(self._calls.items()):
            self._cut[request_id] = f"the scheduler has not answered for {silent:.0f} s"
            call.cancel()

    def _cut_error(self, request_id: str) -> BackendError | None:
        """The error of a call this backend cut, unless the caller itself is being cancelled."""
        reason = self._cut.pop(request_id, None)
        task = asyncio.current_task()
        if reason is None or (task is not None and task.cancelling()):
            return None
        return BackendError(f"scheduler: {reason}")

    def stats(self) -> BackendStats:
        return self._stats

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        try:
            return await self._start(request)
        except _Unavailable as exc:
            if not await self._follow():
                raise _error(exc.rpc) from exc.rpc
        try:
            return await self._start(request)
        except _Unavailable as exc:
            raise _error(exc.rpc) from exc.rpc

    async def _start(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        call = self._stub.Generate(lamina_pb2.GenerateRequest(
            request_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids),
            params=params_to_proto(request.sampling), has_seed=request.sampling.seed is not None,
            prompt_logprobs=request.prompt_logprobs, n=request.n))
        self._calls[request.request_id] = call
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as exc:
            self._calls.pop(request.request_id, None)
            if exc.code() is grpc.StatusCode.UNAVAILABLE:
                raise _Unavailable(exc) from exc
            raise (self._cut_error(request.request_id) or _error(exc)) from exc
        except BaseException as exc:
            # Cancelled while queued (the client left): cancelling the stream aborts it.
            self._calls.pop(request.request_id, None)
            call.cancel()
            cut = self._cut_error(request.request_id) if isinstance(exc, asyncio.CancelledError) else None
            if cut is not None:
                raise cut from None
            raise
        return self._events(request.request_id, call, first, request.prompt_token_ids, request.n)

    async def _events(self, request_id: str, call, first, prompt_ids: tuple[int, ...],
                      n: int) -> AsyncIterator[TokenEvent]:
        remaining = n  # choices that have not finished
        try:
            chunk = first
            while chunk is not grpc.aio.EOF:
                yield TokenEvent(list(chunk.token_ids), chunk.finish_reason or None,
                                 [logprobs_from_proto(t, lp) for t, lp in zip(chunk.token_ids, chunk.logprobs)],
                                 [logprobs_from_proto(t, lp) for t, lp in zip(prompt_ids[1:], chunk.prompt_logprobs)],
                                 chunk.index,
                                 chunk.cached_tokens if chunk.HasField("cached_tokens") else None)
                if chunk.finish_reason and not (remaining := remaining - 1):
                    return
                try:
                    chunk = await call.read()
                except grpc.aio.AioRpcError as exc:
                    raise (self._cut_error(request_id) or _error(exc)) from exc
                except asyncio.CancelledError:
                    cut = self._cut_error(request_id)
                    if cut is None:
                        raise
                    raise cut from None
            raise BackendError("the scheduler ended the stream without a finish reason")
        finally:
            self._calls.pop(request_id, None)
            self._cut.pop(request_id, None)

    async def abort(self, request_id: str, index: int | None = None) -> None:
        if index is None:
            call = self._calls.pop(request_id, None)
            if call is not None:
                call.cancel()  # the scheduler frees the request when its stream is cancelled
        # The scheduler may be gone or have freed the request already: nothing left to abort then.
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self._stub.Abort(lamina_pb2.AbortRequest(request_id=request_id, choice=index), timeout=10)


class _Unavailable(Exception):
    def __init__(self, rpc: grpc.aio.AioRpcError) -> None:
        super().__init__(rpc.details())
        self.rpc = rpc


def _error(exc: grpc.aio.AioRpcError) -> BackendError:
    if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return QueueFullError(exc.details() or "queue full")
    if exc.code() is grpc.StatusCode.INVALID_ARGUMENT:  # the scheduler refused it at admission
        return RequestRefusedError(exc.details() or "refused")
    return BackendError(f"scheduler: {exc.details() or exc.code().name}")
