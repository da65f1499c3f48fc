"""The scheduler: admits requests, places their KV, drives prefill and decode.

The service wires four parts, each a collaborator object in a module of its own, and
holds what they share: the requests (`by_id`, `groups`, `running`), their lifecycle
(submit, accept a token, finish, free KV), the journal, and the gRPC channels it opened.

- `attention` (lamina.services.scheduler.scheduler_attention): the attention pool: membership,
  health probes, sequences to free on a worker once it answers, KV reservations.
- `admission` (lamina.services.scheduler.scheduler_admission): the waiting queue, taken in the order
  of the configured policy (FCFS, Fastest-Prefix-First or Relaxed-FPF over the prefill
  workers' prefix caches), placed on attention workers and prefilled (which yields the
  first token) by the prefill worker lamina.services.scheduler.prefill_routing picks, by the prefix of
  the prompt each holds against the tokens queued there (lamina.services.scheduler.prefill_clients).
- `decode` (lamina.services.scheduler.scheduler_decode): a prefilled request joins the decode stream
  of the least loaded model worker (lamina.services.scheduler.model_streams), which steps it with the
  others in staggered micro-batches and streams its tokens back; the scheduler only
  sends joins and leaves. Prefill and decode run in different processes at the same time.
- `recovery` (lamina.services.scheduler.scheduler_recovery): when a decode step or a prefill fails
  because an attention, prefill or model worker died or stopped answering, the affected
  requests are not ended: they are placed again on attention workers that answer, their
  KV is recomputed from the prompt and the tokens generated so far, and they rejoin a
  live model worker's decode stream (docs/reliability.md). A request ends with an error
  only when no placement works within `deadlines.recovery_s`.

A request's KV is freed only once its model worker has released it (a stop rule,
a leave, a failure), so no step in flight ever writes into freed KV.

A request of n > 1 choices (lamina.services.scheduler.choices) is admitted, placed and prefilled once,
with room reserved for all its choices; after the prefill its attention workers fork
the prompt's KV for choices 1..n-1, which then decode as requests of their own (ids
`<id>/<i>`, each journaled and rebuilt alone after a failure) whose chunks share the
request's stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence

import grpc
import prometheus_client

from lamina.aio import cancel_and_wait, install_uvloop
from lamina.kvstore.metadata import REDIS_ERRORS, KVPlacement
from lamina.model.checkpoints import load_eos_token_ids
from lamina.sampling.params import new_seed
from lamina.sampling.stop import stop_reason
from lamina.services.channels import Channels
from lamina.services.config import StackConfig
from lamina.services.protos import lamina_pb2, lamina_pb2_grpc
from lamina.services.runtime import ServiceRuntime, refresh_every_half_ttl, wait_for_services, workers_by_index
from lamina.services.scheduler.choices import choice_id, choice_seed
from lamina.services.scheduler.journal import Journal
from lamina.services.scheduler.prefill_clients import PrefillClients
from lamina.services.scheduler.scheduler_admission import PEER_FAILURES, Admission
from lamina.services.scheduler.scheduler_attention import AttentionWorkers
from lamina.services.scheduler.scheduler_decode import DecodeStreams
from lamina.services.scheduler.scheduler_recovery import Recovery
from lamina.services.scheduler.scheduler_state import QueueFull, Request, RequestFailed, Status, admission_refusal

log = logging.getLogger(__name__)


class SchedulerService:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.limits = config.scheduler
        eos_ids, model_cfg = load_eos_token_ids(config.model)
        self.eos_ids = set(eos_ids)
        self.max_model_len = model_cfg.max_position_embeddings
        self.runtime = ServiceRuntime("scheduler", "scheduler-0", config)
        self.journal = Journal(self.runtime.store, "scheduler-0")
        self.running: list[Request] = []  # past admission and not finished: decoding, rebuilding or parked
        self.by_id: dict[str, Request] = {}
        # Requests of n > 1 choices: their id -> the choices started so far (lamina.services.scheduler.choices).
        self.groups: dict[str, list[Request]] = {}
        # Its channels to workers, one per worker: a restarted worker's replaces its old one.
        self.channels = Channels(config.cluster_token)
        self._tasks: list[asyncio.Task[None]] = []  # its loops, started by run(), cancelled at shutdown
        self.attention = AttentionWorkers(config, self.runtime.store, self.channels.open)
        # One channel per prefill worker; each prompt goes to the one lamina.services.scheduler.prefill_routing picks.
        self.prefills = PrefillClients(config, self.runtime.store, self.channels.open)
        self.admission = Admission(self)
        self.decode = DecodeStreams(self, lamina_pb2.StopRule(eos_token_ids=sorted(self.eos_ids),
                                                              max_model_len=self.max_model_len))
        r = self.runtime.registry
        self.recovery = Recovery(self, r)
        self.m_waiting = prometheus_client.Gauge("lamina_scheduler_waiting", "requests waiting", registry=r)
        self.m_running = prometheus_client.Gauge("lamina_scheduler_running", "requests decoding", registry=r)
        self.m_reclaimed = prometheus_client.Counter(
            "lamina_scheduler_kv_reclaimed", "sequences attention workers freed because no request held them",
            registry=r)
        self.m_finished = prometheus_client.Counter("lamina_scheduler_finished", "requests finished", ["reason"],
                                                    registry=r)
        self.m_attention = prometheus_client.Gauge(
            "lamina_scheduler_attention_workers", "attention workers requests are placed on", registry=r)
        self.m_attention.set_function(lambda: self.attention.num_members)
        self.m_held = prometheus_client.Counter(
            "lamina_scheduler_held_joins", "prefilled requests that waited to join an idle model worker together",
            registry=r)

    # -- requests ---------------------------------------------------------------------------
    def submit(self, request: lamina_pb2.GenerateRequest) -> Request:
        """Queue a request; returns its first choice (whose events carry every choice's).
        Raises ValueError for a request that can never run, QueueFull when the queue is."""
        rid, n = request.request_id, max(1, request.n)
        if rid in self.by_id or rid in self.groups:
            raise ValueError(f"duplicate request id {rid!r}")
        refusal = admission_refusal(len(request.prompt_token_ids), request.params.max_tokens, n, self.max_model_len,
                                    self.limits.max_batch_size, max(self.attention.capacity_tokens, default=0))
        if refusal is not None:
            raise ValueError(refusal)
        if self.admission.is_full:
            raise QueueFull(f"queue full ({self.limits.max_queue} requests waiting)")
        params = lamina_pb2.SamplingParams()
        params.CopyFrom(request.params)
        if not request.has_seed:
            params.seed = new_seed()
        req = Request(choice_id(rid, 0, n), list(request.prompt_token_ids), params, asyncio.Queue(),
                      max_model_len=self.max_model_len, prompt_logprobs=request.prompt_logprobs,
                      group_id=rid if n > 1 else "", choice_seeds=[choice_seed(params.seed, i) for i in range(1, n)])
        if n > 1:
            self.groups[rid] = [req]
        self.by_id[req.request_id] = req
        self.journal.started(req.request_id, req.prompt_ids, params)
        self.admission.enqueue(req)
        self.update_gauges()
        return req

    async def abort(self, request_id: str, choice: int | None = None) -> None:
        """End a request (every choice, or only `choice` of an n > 1 one); ids that are
        unknown or finished are ignored."""
        members = self.groups.get(request_id)
        if members is None:
            req = self.by_id.get(request_id)
            if req is not None and choice in (None, 0):
                await self._abort_one(req)
            return
        for req in list(members):
            if choice is None or req.index == choice:
                await self._abort_one(req)

    async def _abort_one(self, req: Request) -> None:
        if req.status is Status.WAITING:
            self.admission.waiting.remove(req)
            await self.finish(req, "abort")
        elif req.status is Status.RUNNING:
            await self.finish(req, "abort")  # its model worker is told to drop it
        elif self.decode.unpark(req):  # KV in place, waiting for a model worker: nothing in flight
            await self.finish(req, "abort")
        else:
            # Prefilling or recovering: finished by the task that owns it, after its call.
            req.abort_requested = True

    async def start_choices(self, req: Request, result: lamina_pb2.PrefillResult) -> bool:
        """Start the other choices of an n > 1 request from its prompt's KV, just
        prefilled (lamina.services.scheduler.choices): its attention workers fork that KV for them, then
        each takes its first token from `result` and joins decode. False when the fork
        failed: `req` is then rebuilt (its choices start after that prefill) or ended."""
        if req.forked or not req.choice_seeds or req.abort_requested:
            return True
        n = 1 + len(req.choice_seeds)
        choices = [Request(choice_id(req.group_id, i, n), req.prompt_ids, _with_seed(req.params, seed), req.events,
                           max_model_len=self.max_model_len, workers=list(req.workers), status=Status.PREFILLING,
                           index=i, group_id=req.group_id)
                   for i, seed in enumerate(req.choice_seeds, 1)]
        seq_ids = [c.kv_id for c in choices]
        try:
            await self.attention.fork(req.workers, lamina_pb2.ForkRequest(source=req.kv_id, seq_ids=seq_ids,
                                                                          num_tokens=len(req.prompt_ids)))
        except grpc.aio.AioRpcError as exc:
            await self.attention.free(req.workers, seq_ids)  # those forked on the workers that answered
            if exc.code() in PEER_FAILURES:  # e.g. the worker restarted and lost the prompt
                self.running.append(req)
                self.recovery.start(req, "fork", f"{exc.code().name}: {exc.details()}")
            else:
                log.warning("fork of %s failed: %s", req.request_id, exc.details())
                await self.finish(req, "abort")
            return False
        if req.abort_requested or req.status is Status.FINISHED:  # aborted meanwhile
            await self.attention.free(req.workers, seq_ids)
            return True
        req.forked = True
        logprobs = list(result.choice_logprobs) or [None] * len(choices)
        for c, token, lp in zip(choices, result.choice_token_ids, logprobs):
            c.reserved = c.max_total_tokens - len(c.prompt_ids)  # its own tokens: the prompt's are choice 0's
            req.reserved -= c.reserved
            self.by_id[c.request_id] = c
            self.groups[req.group_id].append(c)
            self.journal.started(c.request_id, c.prompt_ids, c.params)
            await self.record_placement(c)
            await self.accept_token(c, token, lp)
            if c.status is not Status.FINISHED:
                if c.abort_requested or req.abort_requested:  # the request was aborted meanwhile
                    await self.finish(c, "abort")
                else:
                    self.decode.join(c)
        return True

    async def record_placement(self, req: Request) -> None:
        """Write where `req`'s KV is to the metadata store (for observers, and for cleaning
        up after a failed scheduler); the request runs on without it when the store is down."""
        try:
            await self.runtime.store.set_placement(req.request_id, self.placement_of(req))
        except REDIS_ERRORS as exc:
            log.warning("placement of %s not recorded (metadata store unreachable: %s)", req.request_id, exc)

    def placement_of(self, req: Request) -> KVPlacement:
        return KVPlacement(workers=tuple(f"attention-{w}" for w in req.workers), partition=self.config.partition,
                           slab_ranges={})

    async def accept_token(self, req: Request, token: int, logprobs: lamina_pb2.Logprobs | None = None,
                           prompt_logprobs: Sequence[lamina_pb2.Logprobs] = (), cached_tokens: int | None = None
                           ) -> None:
        """`token` is `req`'s next output: send it to the client, end `req` if it stops there.
        `cached_tokens`: with the first token of the request (choice 0), the prompt tokens
        its prefill took from the prefix cache (TokenChunk.cached_tokens)."""
        req.output_ids.append(token)
        self.journal.generated(req.request_id, token)
        reason = stop_reason(req.params, token, len(req.output_ids), req.num_tokens, self.eos_ids,
                             self.max_model_len)
        req.events.put_nowait(lamina_pb2.TokenChunk(token_ids=[token], finish_reason=reason or "",
                                                    logprobs=[logprobs] if logprobs is not None else [],
                                                    prompt_logprobs=prompt_logprobs, index=req.index,
                                                    cached_tokens=cached_tokens))
        if reason is not None:
            await self.finish(req, reason, notify=False)

    async def finish(self, req: Request, reason: str, notify: bool = True) -> None:
        """End `req` for `reason` (its client gets a chunk saying so unless `notify` is
        False); its KV is freed now, or once its model worker lets go of it."""
        if req.status is Status.FINISHED:
            return
        was_placed = req.status is not Status.WAITING
        req.status = Status.FINISHED
        self.by_id.pop(req.request_id, None)
        self.journal.ended(req.request_id)
        if req in self.running:
            self.running.remove(req)
        if notify:
            req.events.put_nowait(lamina_pb2.TokenChunk(finish_reason=reason, index=req.index))
        if not req.forked:  # choices never started end with it
            for i in range(1, 1 + len(req.choice_seeds)):
                req.events.put_nowait(lamina_pb2.TokenChunk(finish_reason="abort", index=i))
        members = self.groups.get(req.group_id)
        if members and all(m.status is Status.FINISHED for m in members):  # (choice 0 forks before it can finish)
            del self.groups[req.group_id]
        self.m_finished.labels(reason).inc()
        # A step of it may be in flight on its model worker: then its KV is freed once the
        # worker lets go (DecodeStreams.released).
        if not self.decode.leave(req) and was_placed:
            await self.free_kv(req)
        self.admission.wake()
        self.update_gauges()

    def live_kv(self) -> dict[int, set[str]]:
        """The KV ids requests hold, by attention worker: every request here and every
        one a model worker has not released yet (finished or not)."""
        live: dict[int, set[str]] = {}
        for req in [*self.by_id.values(), *self.decode.decoding.values()]:
            for w in req.workers:
                live.setdefault(w, set()).add(req.kv_id)
        return live

    async def reconcile_kv(self) -> None:
        """Every half service TTL: Frees that did not reach their worker, then KV no
        request holds, untouched for deadlines.kv_reclaim_s (AttentionWorkers.retain)."""
        await self.attention.free_orphans()
        freed = await self.attention.retain(self.live_kv(), self.config.deadlines.kv_reclaim_s)
        self.m_reclaimed.inc(freed)

    async def free_kv(self, req: Request) -> None:
        """Free `req`'s KV and reservation on its attention workers, and its placement record."""
        self.attention.release(req)
        workers, req.workers = req.workers, []
        await self.attention.free(workers, [req.kv_id])
        try:
            await self.runtime.store.delete_placement(req.request_id)
        except REDIS_ERRORS as exc:
            # Only observers read the record; the next scheduler's start clears what is left.
            log.warning("placement of %s not deleted (metadata store unreachable: %s)", req.request_id, exc)
        self.admission.wake()

    def update_gauges(self) -> None:
        self.m_waiting.set(len(self.admission.waiting))
        self.m_running.set(len(self.running))

    # -- process ----------------------------------------------------------------------------
    async def run(self) -> None:
        rt = self.runtime
        store = rt.store
        ac = self.config.attention
        # By index (a fixed pool has no watcher to bring back one whose entry lapsed
        # between the wait and a listing, so those waited for count).
        registered = await workers_by_index(store, "attention", ac.workers, ac.pool_limit,
                                            lambda info: info.meta.get("grpc", ""))
        prefills = await wait_for_services(store, "prefill", self.config.prefill.workers)
        models = await wait_for_services(store, "model", self.config.model_worker.workers)
        self.attention.grow(ac.workers)  # the slots of workers not registered yet: joined by the watcher
        for w, address in registered.items():
            await self.attention.join(w, address, self.config.deadlines.rpc_s)
        self.prefills.connect(prefills)
        model_channels = [self.channels.open(("model", m.service_id), m.endpoint) for m in models]
        await self.recovery.end_leftovers()
        prefill_hosts = {p.meta.get("host") for p in prefills} - {None}
        self.decode.open(model_channels, [m.meta.get("host") in prefill_hosts for m in models])
        self.journal.start()
        self._tasks = [asyncio.create_task(self.admission.run(), name="admit"),
                       asyncio.create_task(self.decode.watch(), name="model-watchdog"),
                       asyncio.create_task(self.decode.publish_placement_tokens(), name="placement-tokens"),
                       asyncio.create_task(self.prefills.watch(), name="prefill-watch"),
                       asyncio.create_task(refresh_every_half_ttl(store, self.reconcile_kv,
                                                                  "orphaned sequences"), name="attention-orphans")]
        if ac.pool_limit > ac.workers:
            self._tasks.append(asyncio.create_task(
                refresh_every_half_ttl(store, self.attention.refresh, "attention workers"), name="attention-watch"))
        try:
            await rt.serve(lambda s: lamina_pb2_grpc.add_SchedulerServicer_to_server(_SchedulerServicer(self), s),
                           rebuild=self.recovery.republish)
        finally:
            await cancel_and_wait([*self._tasks, *self.admission.tasks, *self.recovery.tasks,
                                               *self.decode.tasks])
            await self.decode.close()
            try:
                await asyncio.wait_for(self.journal.close(), self.config.deadlines.health_s)
            except (TimeoutError, *REDIS_ERRORS) as exc:
                # Shutdown goes on: the next scheduler's start frees what the journal still lists.
                log.warning("journal not flushed at shutdown (%s)", str(exc) or type(exc).__name__)
            await self.channels.close()


class _SchedulerServicer(lamina_pb2_grpc.SchedulerServicer):
    def __init__(self, service: SchedulerService) -> None:
        self.s = service

    async def Generate(self, request: lamina_pb2.GenerateRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> AsyncIterator[lamina_pb2.TokenChunk]:
        try:
            req = self.s.submit(request)
        except QueueFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        remaining = max(1, request.n)  # choices that have not finished
        try:
            while remaining:
                chunk = await req.events.get()
                if isinstance(chunk, RequestFailed):
                    remaining = 0
                    await self.s.abort(request.request_id)  # its other choices, if any
                    await context.abort(grpc.StatusCode.UNAVAILABLE, chunk.message)
                remaining -= bool(chunk.finish_reason)
                yield chunk
        finally:
            if remaining:  # the client went away: free everything the request holds
                await self.s.abort(request.request_id)

    async def Abort(self, request: lamina_pb2.AbortRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> lamina_pb2.Empty:
        await self.s.abort(request.request_id, request.choice if request.HasField("choice") else None)
        return lamina_pb2.Empty()

    async def Stats(self, request: lamina_pb2.Empty,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> lamina_pb2.SchedulerStats:
        s, d = self.s, self.s.decode
        return lamina_pb2.SchedulerStats(
            num_waiting=len(s.admission.waiting), num_running=len(s.running) + s.admission.num_prefilling,
            num_steps=d.num_steps, mean_batch_size=d.sum_batch / d.num_steps if d.num_steps else 0.0,
            max_queue=s.limits.max_queue)


def _with_seed(params: lamina_pb2.SamplingParams, seed: int) -> lamina_pb2.SamplingParams:
    out = lamina_pb2.SamplingParams()
    out.CopyFrom(params)
    out.seed = seed
    return out


def serve(config: StackConfig) -> None:
    install_uvloop()
    asyncio.run(SchedulerService(config).run())
