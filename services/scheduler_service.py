"""The scheduler: admits requests, places their KV, drives prefill and decode.

Two loops, each an owned task: admission takes waiting requests in the order of
the configured policy (FCFS, Fastest-Prefix-First or Relaxed-FPF over the prefill
service's prefix cache),
places them on attention workers, and has the prefill service run them (which
yields the first token); decoding runs steps of all running requests on the
model worker, continuously (requests join and leave between steps). Prefill
and decode run in different processes at the same time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

import grpc
import prometheus_client
import torch

from kvstore.metadata import KVPlacement
from model.loader import load_tokenizer
from services.config import StackConfig
from services.placement import place_request
from services.protos import lamina_pb2, lamina_pb2_grpc
from services.runtime import ServiceRuntime, wait_for_services
from services.scheduler_state import Request, Status, admission_order, can_admit, decode_batch, stop_reason

log = logging.getLogger(__name__)

# Waiting requests a prefix-aware policy considers at each admission.
_POLICY_WINDOW = 32


class SchedulerService:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.limits = config.scheduler
        tokenizer, model_cfg = load_tokenizer(config.model)
        self.eos_ids = set(tokenizer.eos_token_ids)
        self.max_model_len = model_cfg.max_position_embeddings
        self.runtime = ServiceRuntime("scheduler", "scheduler-0", config)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.by_id: dict[str, Request] = {}
        # Tokens reserved on each attention worker: prompt + max_tokens of every placed
        # request, so a request admitted now can always finish without running out of KV.
        self.reserved_tokens = [0] * config.attention.workers
        self.capacity_tokens = [0] * config.attention.workers
        self.num_prefilling = 0
        self.num_steps = 0
        self.sum_batch = 0
        self._wake_admit = asyncio.Event()
        self._wake_decode = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._prefills: set[asyncio.Task] = set()  # owned: cancelled at shutdown
        r = self.runtime.registry
        self.m_waiting = prometheus_client.Gauge("lamina_scheduler_waiting", "requests waiting", registry=r)
        self.m_running = prometheus_client.Gauge("lamina_scheduler_running", "requests decoding", registry=r)
        self.m_finished = prometheus_client.Counter("lamina_scheduler_finished", "requests finished", ["reason"],
                                                    registry=r)

    # -- requests ---------------------------------------------------------------------------
    def submit(self, request: lamina_pb2.GenerateRequest) -> Request:
        if request.request_id in self.by_id:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if not request.prompt_token_ids:
            raise ValueError("the prompt is empty")
        if len(request.prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(request.prompt_token_ids)} tokens; "
                             f"the model's context length is {self.max_model_len}")
        most = max(self.capacity_tokens) if self.capacity_tokens else 0
        need = min(len(request.prompt_token_ids) + request.params.max_tokens, self.max_model_len)
        if need > most:
            raise ValueError(f"prompt plus max_tokens ({need} tokens) exceeds the KV capacity of an attention "
                             f"worker ({most} tokens)")
        if len(self.waiting) >= self.limits.max_queue:
            raise OverflowError(f"queue full ({self.limits.max_queue} requests waiting)")
        params = lamina_pb2.SamplingParams()
        params.CopyFrom(request.params)
        if not request.has_seed:
            params.seed = int(torch.randint(0, 2**62, (1,)).item())
        req = Request(request.request_id, list(request.prompt_token_ids), params, asyncio.Queue(),
                      max_model_len=self.max_model_len)
        self.waiting.append(req)
        self.by_id[req.request_id] = req
        self._wake_admit.set()
        self._update_gauges()
        return req

    async def abort(self, request_id: str) -> None:
        req = self.by_id.get(request_id)
        if req is None:
            return
        if req.status is Status.WAITING:
            self.waiting.remove(req)
            await self._finish(req, "abort")
        else:
            # Prefilling or inside a step: finished by the loop that owns it, after that call.
            req.abort_requested = True

    # -- loops ------------------------------------------------------------------------------
    async def _admit_loop(self) -> None:
        while True:
            await self._wake_admit.wait()
            self._wake_admit.clear()
            while self.waiting and self._room_for_one():
                # One ordering per window, then as many admissions as there is room for:
                # asking the prefill service per admission would wait behind its running
                # forward each time, and prompts could not gather for a shared forward.
                admitted = 0
                for req in await self._admission_order():
                    if not self._room_for_one():
                        break
                    if req not in self.waiting:
                        continue  # aborted while the order was computed
                    if not self._place(req):
                        break  # no KV room until a running request finishes (which wakes this loop)
                    self.waiting.remove(req)
                    self._start_prefill(req)
                    admitted += 1
                if not admitted:
                    break

    def _room_for_one(self) -> bool:
        return can_admit(len(self.running), self.num_prefilling, self.limits.max_batch_size)

    def _start_prefill(self, req: Request) -> None:
        # Prefills run concurrently (the prefill service batches those that wait
        # together); counted as prefilling from here, so admission sees them.
        req.status = Status.PREFILLING
        self.num_prefilling += 1
        task = asyncio.create_task(self._prefill(req), name=f"prefill-{req.request_id}")
        self._prefills.add(task)
        task.add_done_callback(self._prefills.discard)

    async def _admission_order(self) -> list[Request]:
        """The first `_POLICY_WINDOW` waiting requests in the order to admit them: arrival
        order for FCFS; the prefix-aware policies order them by cached-prefix tier
        distance (asked of the prefill service once per window)."""
        window = list(self.waiting)[:_POLICY_WINDOW]
        if self.limits.policy == "fcfs":
            return window
        try:
            result = await self.prefill_stub.TierDistances(lamina_pb2.TierDistanceRequest(prompts=[
                lamina_pb2.TierDistanceRequest.Prompt(token_ids=r.prompt_ids) for r in window]), timeout=10)
            distances = list(result.distances)
        except grpc.aio.AioRpcError as exc:
            log.warning("tier distances unavailable (%s); admitting in arrival order", exc.details())
            return window
        return admission_order(window, distances, self.limits.policy, time.monotonic())

    def _place(self, req: Request) -> bool:
        workers = place_request(self.config.partition, self.reserved_tokens, self.capacity_tokens, req.max_total_tokens)
        if workers is None:
            return False
        req.workers = workers
        for w in workers:
            self.reserved_tokens[w] += req.max_total_tokens
        return True

    async def _prefill(self, req: Request) -> None:
        try:
            await self._run_prefill(req)
        except Exception:  # e.g. the metadata store failed: this request ends, the others go on
            log.exception("prefill of %s failed", req.request_id)
            if req.status is Status.PREFILLING:
                self.num_prefilling -= 1
                await self._finish(req, "abort")
        finally:
            self._wake_admit.set()  # a prefill slot is free again

    async def _run_prefill(self, req: Request) -> None:
        try:
            await self.runtime.store.set_placement(req.request_id, KVPlacement(
                workers=tuple(f"attention-{w}" for w in req.workers), partition=self.config.partition,
                slab_ranges={}))
            result = await self.prefill_stub.Prefill(lamina_pb2.PrefillRequest(
                seq_id=req.request_id, token_ids=req.prompt_ids, params=req.params,
                placement=lamina_pb2.Placement(workers=req.workers)))
        except grpc.aio.AioRpcError as exc:
            self.num_prefilling -= 1
            if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and (self.running or self.num_prefilling):
                # KV memory is full after all: retry once running (or other prefilling)
                # requests have freed some.
                self._release(req)
                req.workers = []
                req.status = Status.WAITING
                self.waiting.appendleft(req)
                return
            log.warning("prefill of %s failed: %s", req.request_id, exc.details())
            await self._finish(req, "abort")
            return
        self.num_prefilling -= 1
        await self._accept_token(req, result.token_id)
        if req.status is not Status.FINISHED:
            if req.abort_requested:
                await self._finish(req, "abort")
            else:
                req.status = Status.RUNNING
                self.running.append(req)
                self._wake_decode.set()
        self._update_gauges()

    async def _decode_loop(self) -> None:
        while True:
            batch = decode_batch(self.running, self.limits.max_batch_size)
            if not batch:
                for req in [r for r in self.running if r.abort_requested]:
                    await self._finish(req, "abort")
                self._wake_decode.clear()
                await self._wake_decode.wait()
                continue
            step = lamina_pb2.StepRequest(step=self.num_steps, seqs=[
                lamina_pb2.StepSequence(seq_id=r.request_id, token_id=r.output_ids[-1], position=r.num_tokens - 1,
                                        params=r.params, output_index=len(r.output_ids),
                                        placement=lamina_pb2.Placement(workers=r.workers))
                for r in batch])
            try:
                result = await self.model_stub.Step(step)
            except grpc.aio.AioRpcError as exc:
                log.error("decode step failed: %s", exc.details())
                for req in batch:
                    await self._finish(req, "abort")
                continue
            self.num_steps += 1
            self.sum_batch += len(batch)
            for req, token in zip(batch, result.token_ids):
                await self._accept_token(req, token)
                if req.status is not Status.FINISHED and req.abort_requested:
                    await self._finish(req, "abort")
            for req in [r for r in self.running if r.abort_requested]:
                await self._finish(req, "abort")

    async def _accept_token(self, req: Request, token: int) -> None:
        req.output_ids.append(token)
        reason = stop_reason(req, token, self.eos_ids, self.max_model_len)
        req.events.put_nowait(lamina_pb2.TokenChunk(token_ids=[token], finish_reason=reason or ""))
        if reason is not None:
            await self._finish(req, reason, notify=False)

    async def _finish(self, req: Request, reason: str, notify: bool = True) -> None:
        if req.status is Status.FINISHED:
            return
        was_placed = req.status is not Status.WAITING
        req.status = Status.FINISHED
        self.by_id.pop(req.request_id, None)
        if req in self.running:
            self.running.remove(req)
        if notify:
            req.events.put_nowait(lamina_pb2.TokenChunk(finish_reason=reason))
        self.m_finished.labels(reason).inc()
        if was_placed:
            self._release(req)
            await asyncio.gather(*(self.attention_stubs[w].Free(lamina_pb2.FreeRequest(seq_ids=[req.request_id]))
                                   for w in req.workers), return_exceptions=True)
            with contextlib.suppress(Exception):
                await self.runtime.store.delete_placement(req.request_id)
        self._wake_admit.set()
        self._update_gauges()

    def _release(self, req: Request) -> None:
        for w in req.workers:
            self.reserved_tokens[w] -= req.max_total_tokens

    def _update_gauges(self) -> None:
        self.m_waiting.set(len(self.waiting))
        self.m_running.set(len(self.running))

    # -- process ----------------------------------------------------------------------------
    async def run(self) -> None:
        rt = self.runtime
        store = rt.store
        attn = await wait_for_services(store, "attention", self.config.attention.workers)
        (prefill,) = await wait_for_services(store, "prefill", 1)
        (model,) = await wait_for_services(store, "model", 1)
        self._channels = [grpc.aio.insecure_channel(a.meta["grpc"]) for a in attn]
        self._channels += [grpc.aio.insecure_channel(prefill.endpoint), grpc.aio.insecure_channel(model.endpoint)]
        self.attention_stubs = [lamina_pb2_grpc.AttentionControlStub(c) for c in self._channels[: len(attn)]]
        for w, stub in enumerate(self.attention_stubs):
            self.capacity_tokens[w] = (await stub.Stats(lamina_pb2.Empty(), timeout=30)).capacity_tokens
        self.prefill_stub = lamina_pb2_grpc.PrefillStub(self._channels[-2])
        self.model_stub = lamina_pb2_grpc.ModelWorkerStub(self._channels[-1])
        self._tasks = [asyncio.create_task(self._admit_loop(), name="admit"),
                       asyncio.create_task(self._decode_loop(), name="decode")]
        try:
            await rt.serve(lambda s: lamina_pb2_grpc.add_SchedulerServicer_to_server(_SchedulerServicer(self), s))
        finally:
            tasks = [*self._tasks, *self._prefills]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for c in self._channels:
                await c.close()


class _SchedulerServicer(lamina_pb2_grpc.SchedulerServicer):
    def __init__(self, service: SchedulerService) -> None:
        self.s = service

    async def Generate(self, request, context):  # noqa: N802
        try:
            req = self.s.submit(request)
        except OverflowError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        finished = False
        try:
            while not finished:
                chunk = await req.events.get()
                finished = bool(chunk.finish_reason)
                yield chunk
        finally:
            if not finished:  # the client went away: free everything the request holds
                await self.s.abort(req.request_id)

    async def Abort(self, request, context):  # noqa: N802
        await self.s.abort(request.request_id)
        return lamina_pb2.Empty()

    async def Stats(self, request, context):  # noqa: N802
        s = self.s
        return lamina_pb2.SchedulerStats(
            num_waiting=len(s.waiting), num_running=len(s.running) + s.num_prefilling, num_steps=s.num_steps,
            mean_batch_size=s.sum_batch / s.num_steps if s.num_steps else 0.0, max_queue=s.limits.max_queue)


def serve(config: StackConfig) -> None:
    torch.set_num_threads(1)
    import transports

    transports.install_uvloop()
    asyncio.run(SchedulerService(config).run())
