"""The scheduler: admits requests, places their KV, drives prefill and decode.

Admission is an owned task: it takes waiting requests in the order of the
configured policy (FCFS, Fastest-Prefix-First or Relaxed-FPF over the prefill
service's prefix cache), places them on attention workers, and has the prefill
service run them (which yields the first token). A prefilled request then joins
the decode stream of the least loaded model worker (services.model_streams),
which steps it with the others in staggered micro-batches and streams its tokens
back; the scheduler only sends joins and leaves. Prefill and decode run in
different processes at the same time.

A request's KV is freed only once its model worker has released it (a stop rule,
a leave, a failure), so no step in flight ever writes into freed KV.
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
from services.micro_batches import join_target
from services.model_streams import ModelStream
from services.scheduler_state import Request, Status, admission_order, can_admit, stop_reason

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
        self.decoding: dict[str, Request] = {}  # held by a model worker (joined, not yet released)
        self.model_streams: list[ModelStream] = []
        self._wake_admit = asyncio.Event()
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
        elif req.status is Status.RUNNING:
            await self._finish(req, "abort")  # its model worker is told to drop it
        else:
            # Prefilling: finished by the task that owns the prefill, after that call.
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
                self._join_decode(req)
        self._update_gauges()

    # -- decoding ---------------------------------------------------------------------------
    def _join_decode(self, req: Request) -> None:
        """Hand a prefilled request to the least loaded model worker's decode stream."""
        w = join_target([m.num_sequences for m in self.model_streams])
        req.status = Status.RUNNING
        req.model_worker = w
        self.running.append(req)
        self.decoding[req.request_id] = req
        self.model_streams[w].join([lamina_pb2.StepSequence(
            seq_id=req.request_id, token_id=req.output_ids[-1], position=req.num_tokens - 1, params=req.params,
            output_index=len(req.output_ids), placement=lamina_pb2.Placement(workers=req.workers))])

    async def _on_decode_result(self, worker: int, result: lamina_pb2.DecodeResult) -> None:
        if result.tokens:
            self.num_steps += 1
            self.sum_batch += len(result.tokens)
        for t in result.tokens:
            req = self.decoding.get(t.seq_id)
            if req is None:
                continue
            if req.status is not Status.FINISHED:
                await self._accept_token(req, t.token_id)
            if t.finished:
                if req.status is not Status.FINISHED:
                    # Both sides end a sequence by stop_reason: this would be a bug, not a race.
                    log.error("model worker %d ended %s, which the scheduler would continue", worker, t.seq_id)
                    await self._finish(req, "abort")
                await self._released(req)
        for sid in result.left:
            req = self.decoding.get(sid)
            if req is not None:
                await self._released(req)
        for f in result.failed:
            req = self.decoding.get(f.seq_id)
            if req is not None:
                log.warning("decode of %s failed on model worker %d: %s", f.seq_id, worker, f.message)
                await self._finish(req, "abort")
                await self._released(req)

    async def _on_decode_lost(self, worker: int, error: str) -> None:
        reqs = [r for r in self.decoding.values() if r.model_worker == worker]
        log.error("decode stream of model worker %d lost (%s); ending its %d requests", worker, error, len(reqs))
        for req in reqs:
            await self._finish(req, "abort")
            await self._released(req)

    async def _released(self, req: Request) -> None:
        """The model worker holds `req` no more: no frame of it is in flight, its KV can go."""
        if self.decoding.pop(req.request_id, None) is None:
            return
        self.model_streams[req.model_worker].released()
        await self._free_kv(req)

    async def _accept_token(self, req: Request, token: int) -> None:
        req.output_ids.append(token)
        reason = stop_reason(req.params, token, len(req.output_ids), req.num_tokens, self.eos_ids,
                             self.max_model_len)
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
        if req.request_id in self.decoding:
            # A step of it may be in flight: its KV is freed once the model worker lets go.
            self.model_streams[req.model_worker].leave([req.request_id])
        elif was_placed:
            await self._free_kv(req)
        self._wake_admit.set()
        self._update_gauges()

    async def _free_kv(self, req: Request) -> None:
        self._release(req)
        await asyncio.gather(*(self.attention_stubs[w].Free(lamina_pb2.FreeRequest(seq_ids=[req.request_id]))
                               for w in req.workers), return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.runtime.store.delete_placement(req.request_id)
        self._wake_admit.set()

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
        models = await wait_for_services(store, "model", self.config.model_worker.workers)
        self._channels = [grpc.aio.insecure_channel(a.meta["grpc"]) for a in attn]
        self._channels.append(grpc.aio.insecure_channel(prefill.endpoint))
        model_channels = [grpc.aio.insecure_channel(m.endpoint) for m in models]
        self._channels += model_channels
        self.attention_stubs = [lamina_pb2_grpc.AttentionControlStub(c) for c in self._channels[: len(attn)]]
        for w, stub in enumerate(self.attention_stubs):
            self.capacity_tokens[w] = (await stub.Stats(lamina_pb2.Empty(), timeout=30)).capacity_tokens
        self.prefill_stub = lamina_pb2_grpc.PrefillStub(self._channels[len(attn)])
        stop = lamina_pb2.StopRule(eos_token_ids=sorted(self.eos_ids), max_model_len=self.max_model_len)
        self.model_streams = [ModelStream(i, lamina_pb2_grpc.ModelWorkerStub(c), stop, self._on_decode_result,
                                          self._on_decode_lost) for i, c in enumerate(model_channels)]
        for m in self.model_streams:
            m.open()
        self._tasks = [asyncio.create_task(self._admit_loop(), name="admit")]
        try:
            await rt.serve(lambda s: lamina_pb2_grpc.add_SchedulerServicer_to_server(_SchedulerServicer(self), s))
        finally:
            tasks = [*self._tasks, *self._prefills]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(*(m.close() for m in self.model_streams), return_exceptions=True)
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
