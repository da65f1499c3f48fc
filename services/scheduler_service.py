"""The scheduler: admits requests, places their KV, drives prefill and decode.

Admission is an owned task: it takes waiting requests in the order of the
configured policy (FCFS, Fastest-Prefix-First or Relaxed-FPF over the prefill
workers' prefix caches), places them on attention workers, and has a prefill worker
run them (which yields the first token): the one lamina.services.prefill_routing picks, by
the prefix of the prompt each holds (the metadata store's block records) against the
tokens queued there (lamina.services.prefill_clients). A prefilled request then joins
the decode stream of the least loaded model worker (lamina.services.model_streams),
which steps it with the others in staggered micro-batches and streams its tokens
back; the scheduler only sends joins and leaves. Prefill and decode run in
different processes at the same time.

A request's KV is freed only once its model worker has released it (a stop rule,
a leave, a failure), so no step in flight ever writes into freed KV.

A request of n > 1 choices (lamina.services.choices) is admitted, placed and prefilled once,
with room reserved for all its choices; after the prefill its attention workers fork
the prompt's KV for choices 1..n-1, which then decode as requests of their own (ids
`<id>/<i>`, each journaled and rebuilt alone after a failure) whose chunks share the
request's stream.

Failures (docs/reliability.md): when a decode step or a prefill fails because an
attention worker, a prefill worker or a model worker died or stopped answering,
the affected requests are not ended: their KV is freed where it can be, they are
placed again on attention workers that answer a health probe (a restarted one
included, found anew in the metadata store), and the prefill service recomputes
their KV from the prompt and the tokens generated so far (a live prefill worker;
its prefix cache serves the prompt); then they rejoin a live model worker's decode stream. Sampling is seeded
per output index, so the stream goes on with the tokens it would have had. A request
ends with an error only when no placement works within `deadlines.recovery_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Sequence

import grpc
import prometheus_client
import torch

from lamina.kvstore.cancellation import raise_if_cancelled
from lamina.kvstore.metadata import REDIS_ERRORS, KVPlacement
from lamina.model.loader import load_tokenizer
from lamina.services import stack_dumps
from lamina.services.channels import open_channel
from lamina.services.choices import choice_id, choice_seed, reserve_tokens
from lamina.services.config import StackConfig
from lamina.services.journal import Journal
from lamina.services.attention_members import membership, worker_index
from lamina.services.placement import place_request
from lamina.services.prefill_clients import PrefillClients
from lamina.services.protos import lamina_pb2, lamina_pb2_grpc
from lamina.services.runtime import ServiceRuntime, refresh_every_half_ttl, wait_for_services, workers_by_index
from lamina.services.sampling_wire import join_history, logprobs_of
from lamina.services.micro_batches import join_target
from lamina.services.rotation import coordinator
from lamina.services.model_streams import ModelStream
from lamina.services.scheduler_state import Request, Status, admission_order, can_admit, kv_id, stop_reason

log = logging.getLogger(__name__)

# Waiting requests a prefix-aware policy considers at each admission.
_POLICY_WINDOW = 32
# A request whose KV had to be rebuilt this often is failing for a reason a rebuild
# does not cure: it ends with an error.
_MAX_RECOVERIES = 3
# How often the tokens each placed request holds are written to its placement.
_PLACEMENT_TOKENS_S = 0.5
# gRPC codes of a peer that is gone, restarting or not answering: worth a rebuild.
_PEER_FAILURES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                  grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)


class _NotYet(Exception):
    """A rebuild cannot proceed now (no worker up with room, prefill unreachable)."""


@dataclasses.dataclass(frozen=True)
class RequestFailed:
    """Put on a request's event queue in place of a chunk: its stream ends with this error."""

    message: str


class SchedulerService:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.limits = config.scheduler
        tokenizer, model_cfg = load_tokenizer(config.model)
        self.eos_ids = set(tokenizer.eos_token_ids)
        self.max_model_len = model_cfg.max_position_embeddings
        self.runtime = ServiceRuntime("scheduler", "scheduler-0", config)
        self.journal = Journal(self.runtime.store, "scheduler-0")
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.by_id: dict[str, Request] = {}
        # Requests of n > 1 choices: their id -> the choices started so far (lamina.services.choices).
        self.groups: dict[str, list[Request]] = {}
        # Tokens reserved on each attention worker: prompt + max_tokens of every placed
        # request, so a request admitted now can always finish without running out of KV.
        self.reserved_tokens: list[int] = []  # per attention worker; sized in run() (_grow_attention)
        self.capacity_tokens: list[int] = []
        self.num_prefilling = 0
        self.num_steps = 0
        self.sum_batch = 0
        self.decoding: dict[str, Request] = {}  # held by a model worker (joined, not yet released)
        self.model_streams: list[ModelStream] = []
        self._wake_admit = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._prefills: set[asyncio.Task] = set()  # owned: cancelled at shutdown
        self._recoveries: set[asyncio.Task] = set()  # owned: rebuilds and model-stream reopenings
        self._parked: list[Request] = []  # KV in place, waiting for a live model worker
        # Sequences to free on an attention worker once it answers again (it did not when
        # their requests were moved away).
        self._orphans: dict[int, set[str]] = {}
        self._attention_grpc: list[str] = []  # each attention worker's gRPC address in use
        self.attention_stubs: list[lamina_pb2_grpc.AttentionControlStub | None] = []
        # Pool members whose registration is gone (stopped, or never registered below the
        # highest index): no new request is placed there (services/attention_members.py).
        self._attention_left: set[int] = set()
        # One channel per prefill worker; each prompt goes to the one lamina.services.prefill_routing picks.
        self.prefills = PrefillClients(config, self.runtime.store, self._channel)
        r = self.runtime.registry
        self.m_waiting = prometheus_client.Gauge("lamina_scheduler_waiting", "requests waiting", registry=r)
        self.m_running = prometheus_client.Gauge("lamina_scheduler_running", "requests decoding", registry=r)
        self.m_finished = prometheus_client.Counter("lamina_scheduler_finished", "requests finished", ["reason"],
                                                    registry=r)
        self.m_attention = prometheus_client.Gauge(
            "lamina_scheduler_attention_workers", "attention workers requests are placed on", registry=r)
        self.m_attention.set_function(lambda: len(self.attention_stubs) - len(self._attention_left))
        self.m_recovered = prometheus_client.Counter(
            "lamina_scheduler_rebuilds", "requests whose KV was rebuilt after a worker failed", ["stage"], registry=r)

    # -- requests ---------------------------------------------------------------------------
    def submit(self, request: lamina_pb2.GenerateRequest) -> Request:
        """Queue a request; returns its first choice (whose events carry every choice's)."""
        rid, n = request.request_id, max(1, request.n)
        if rid in self.by_id or rid in self.groups:
            raise ValueError(f"duplicate request id {rid!r}")
        if not request.prompt_token_ids:
            raise ValueError("the prompt is empty")
        if len(request.prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(request.prompt_token_ids)} tokens; "
                             f"the model's context length is {self.max_model_len}")
        if n > self.limits.max_batch_size:
            raise ValueError(f"n={n} choices exceed the decode batch ({self.limits.max_batch_size} sequences)")
        most = max(self.capacity_tokens) if self.capacity_tokens else 0
        num_prompt = len(request.prompt_token_ids)
        need = reserve_tokens(num_prompt, min(num_prompt + request.params.max_tokens, self.max_model_len), n - 1)
        if need > most:
            what = "prompt plus max_tokens" if n == 1 else f"prompt plus {n} choices of max_tokens"
            raise ValueError(f"{what} ({need} tokens) exceeds the KV capacity of an attention worker "
                             f"({most} tokens)")
        if len(self.waiting) >= self.limits.max_queue:
            raise OverflowError(f"queue full ({self.limits.max_queue} requests waiting)")
        params = lamina_pb2.SamplingParams()
        params.CopyFrom(request.params)
        if not request.has_seed:
            params.seed = int(torch.randint(0, 2**62, (1,)).item())
        req = Request(choice_id(rid, 0, n), list(request.prompt_token_ids), params, asyncio.Queue(),
                      max_model_len=self.max_model_len, prompt_logprobs=request.prompt_logprobs,
                      group_id=rid if n > 1 else "", choice_seeds=[choice_seed(params.seed, i) for i in range(1, n)])
        if n > 1:
            self.groups[rid] = [req]
        self.waiting.append(req)
        self.by_id[req.request_id] = req
        self.journal.started(req.request_id, req.prompt_ids, params)
        self._wake_admit.set()
        self._update_gauges()
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
            self.waiting.remove(req)
            await self._finish(req, "abort")
        elif req.status is Status.RUNNING:
            await self._finish(req, "abort")  # its model worker is told to drop it
        elif req in self._parked:  # KV in place, waiting for a model worker: nothing in flight
            self._parked.remove(req)
            await self._finish(req, "abort")
        else:
            # Prefilling or recovering: finished by the task that owns it, after its call.
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
                    if not self._room_for(req):
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

    def _room_for(self, req: Request) -> bool:
        return can_admit(len(self.running), self.num_prefilling, self.limits.max_batch_size, req.num_slots)

    def _start_prefill(self, req: Request) -> None:
        # Prefills run concurrently (the prefill service batches those that wait
        # together); counted as prefilling from here, so admission sees them.
        req.status = Status.PREFILLING
        self.num_prefilling += req.num_slots
        task = asyncio.create_task(self._prefill(req), name=f"prefill-{req.request_id}")
        self._prefills.add(task)
        task.add_done_callback(self._prefills.discard)

    async def _admission_order(self) -> list[Request]:
        """The first `_POLICY_WINDOW` waiting requests in the order to admit them: arrival
        order for FCFS; the prefix-aware policies order them by cached-prefix tier
        distance (asked of the prefill workers once per window; a prompt's distance is
        the nearest tier any of them holds its prefix in)."""
        window = list(self.waiting)[:_POLICY_WINDOW]
        if self.limits.policy == "fcfs":
            return window
        distances = await self.prefills.tier_distances([r.prompt_ids for r in window])
        if distances is None:
            return window
        return admission_order(window, distances, self.limits.policy, time.monotonic())

    def _place(self, req: Request, capacity: Sequence[int] | None = None) -> bool:
        """Reserve room for the request's KV (its choices' included) on workers with
        room (of `capacity`, default every worker's); False when none has it now."""
        need = req.reserve_tokens
        workers = place_request(self.config.partition, self.reserved_tokens, capacity or self._placeable(), need)
        if workers is None:
            return False
        req.workers, req.reserved = workers, need
        for w in workers:
            self.reserved_tokens[w] += need
        return True

    def _placeable(self) -> list[int]:
        """Each attention worker's KV capacity in tokens, 0 for one that left the pool."""
        return [0 if w in self._attention_left else c for w, c in enumerate(self.capacity_tokens)]

    async def _prefill(self, req: Request) -> None:
        try:
            await self._run_prefill(req)
        except Exception:  # e.g. the metadata store failed: this request ends, the others go on
            log.exception("prefill of %s failed", req.request_id)
            if req.status is Status.PREFILLING:  # (no longer counted as prefilling: _run_prefill)
                await self._finish(req, "abort")
        finally:
            self._wake_admit.set()  # a prefill slot is free again

    async def _prefill_call(self, req: Request, token_ids: list[int]) -> lamina_pb2.PrefillResult:
        """Record the placement and have a prefill worker (the one the routing picks)
        compute `token_ids`' KV on it; _NotYet when no prefill worker is alive.

        The record is for observers (lamina status) and for cleaning up after a failed
        scheduler; with the metadata store unreachable the request still runs, and its
        placement is written again when the store is back (`_republish`)."""
        route = await self.prefills.route(token_ids)
        if route is None:
            raise _NotYet("no prefill worker answers")
        worker, cached_tokens, fetch = route
        await self._record_placement(req)
        return await self.prefills.prefill(worker, lamina_pb2.PrefillRequest(
            seq_id=req.kv_id, token_ids=token_ids, params=req.params,
            placement=lamina_pb2.Placement(workers=req.workers),
            prompt_logprobs=req.prompt_logprobs and not req.output_ids,
            choice_seeds=[] if req.forked else req.choice_seeds,
            peer=self.prefills.peer_prefix(fetch) if fetch is not None else None), cached_tokens)

    async def _record_placement(self, req: Request) -> None:
        try:
            await self.runtime.store.set_placement(req.request_id, self._placement_of(req))
        except REDIS_ERRORS as exc:
            log.warning("placement of %s not recorded (metadata store unreachable: %s)", req.request_id, exc)

    def _placement_of(self, req: Request) -> KVPlacement:
        return KVPlacement(workers=tuple(f"attention-{w}" for w in req.workers), partition=self.config.partition,
                           slab_ranges={})

    async def _run_prefill(self, req: Request) -> None:
        try:
            try:
                result = await self._prefill_call(req, req.prompt_ids)
            finally:  # counted as prefilling until the call ends, however it ends: exactly once
                self.num_prefilling -= req.num_slots
        except _NotYet as exc:  # no prefill worker alive: wait for one as a rebuild does
            self.running.append(req)
            self._start_recovery(req, "prefill", str(exc))
            return
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and (self.running or self.num_prefilling):
                # KV memory is full after all: retry once running (or other prefilling)
                # requests have freed some.
                self._release(req)
                req.workers = []
                req.status = Status.WAITING
                self.waiting.appendleft(req)
                return
            if exc.code() in _PEER_FAILURES:
                # A worker died or stopped answering: place it again and prefill anew.
                self.running.append(req)
                self._start_recovery(req, "prefill", f"{exc.code().name}: {exc.details()}")
                return
            log.warning("prefill of %s failed: %s", req.request_id, exc.details())
            await self._finish(req, "abort")
            return
        if not await self._start_choices(req, result):
            return
        await self._accept_token(req, result.token_id, logprobs_of(result), result.prompt_logprobs)
        if req.status is not Status.FINISHED:
            if req.abort_requested:
                await self._finish(req, "abort")
            else:
                self._join_decode(req)
        self._update_gauges()

    async def _start_choices(self, req: Request, result: lamina_pb2.PrefillResult) -> bool:
        """Start the other choices of an n > 1 request from its prompt's KV, just
        prefilled (lamina.services.choices): its attention workers fork that KV for them, then
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
        fork = lamina_pb2.ForkRequest(source=req.kv_id, seq_ids=seq_ids, num_tokens=len(req.prompt_ids))
        try:
            await asyncio.gather(*(self.attention_stubs[w].Fork(fork, timeout=self.config.deadlines.rpc_s)
                                   for w in req.workers))
        except grpc.aio.AioRpcError as exc:
            await self._free_seqs(req.workers, seq_ids)  # those forked on the workers that answered
            if exc.code() in _PEER_FAILURES:  # e.g. the worker restarted and lost the prompt
                self.running.append(req)
                self._start_recovery(req, "fork", f"{exc.code().name}: {exc.details()}")
            else:
                log.warning("fork of %s failed: %s", req.request_id, exc.details())
                await self._finish(req, "abort")
            return False
        if req.abort_requested or req.status is Status.FINISHED:  # aborted meanwhile
            await self._free_seqs(req.workers, seq_ids)
            return True
        req.forked = True
        logprobs = list(result.choice_logprobs) or [None] * len(choices)
        for c, token, lp in zip(choices, result.choice_token_ids, logprobs):
            c.reserved = c.max_total_tokens - len(c.prompt_ids)  # its own tokens: the prompt's are choice 0's
            req.reserved -= c.reserved
            self.by_id[c.request_id] = c
            self.groups[req.group_id].append(c)
            self.journal.started(c.request_id, c.prompt_ids, c.params)
            await self._record_placement(c)
            await self._accept_token(c, token, lp)
            if c.status is not Status.FINISHED:
                if c.abort_requested or req.abort_requested:  # the request was aborted meanwhile
                    await self._finish(c, "abort")
                else:
                    self._join_decode(c)
        return True

    # -- decoding ---------------------------------------------------------------------------
    def _join_decode(self, req: Request) -> None:
        """Hand a prefilled request to the least loaded live model worker's decode
        stream (rotational: the coordinator's, lamina.services.rotation); with none live, it
        waits (KV in place) for one to come back."""
        if req not in self.running:
            self.running.append(req)
        live = [i for i, m in enumerate(self.model_streams) if m.alive]
        if not live:
            req.status = Status.RECOVERING
            self._parked.append(req)
            return
        loads = [self.model_streams[i].num_sequences for i in live]
        w = live[coordinator(loads) if self.config.rotational else join_target(loads)]
        req.status = Status.RUNNING
        req.model_worker = w
        self.decoding[req.kv_id] = req
        self.model_streams[w].join([lamina_pb2.StepSequence(
            seq_id=req.kv_id, token_id=req.output_ids[-1], position=req.num_tokens - 1, params=req.params,
            output_index=len(req.output_ids), placement=lamina_pb2.Placement(workers=req.workers),
            **join_history(req.params, req.prompt_ids, req.output_ids))])

    async def _on_decode_result(self, worker: int, result: lamina_pb2.DecodeResult) -> None:
        if result.tokens:
            self.num_steps += 1
            self.sum_batch += len(result.tokens)
        for t in result.tokens:
            req = self.decoding.get(t.seq_id)
            if req is None:
                continue
            if req.status is not Status.FINISHED:
                await self._accept_token(req, t.token_id, logprobs_of(t))
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
            if req is None:
                continue
            # The model worker dropped it: no frame of it is in flight any more.
            await self._released(req, rebuild_why=f"model worker {worker}: {f.code}: {f.message}")

    async def _on_decode_lost(self, worker: int, error: str) -> None:
        stream = self.model_streams[worker]
        stream.alive = False
        reqs = [r for r in self.decoding.values() if r.model_worker == worker]
        log.error("decode stream of model worker %d lost (%s); rebuilding its %d requests elsewhere",
                  worker, error, len(reqs))
        for req in reqs:
            # The worker is gone or its stream is: a step of these may have written part
            # of a token's KV, so each is rebuilt whole.
            await self._released(req, rebuild_why=f"model worker {worker}: {error}", stage="model")
        self._own(self._reopen_model_stream(worker), f"reopen-model-{worker}")

    async def _released(self, req: Request, rebuild_why: str | None = None, stage: str = "decode") -> None:
        """The model worker holds `req` no more: no frame of it is in flight, its KV can go.

        With `rebuild_why` (its step failed, or its worker was lost), a request that has
        not finished is rebuilt instead (which frees its KV first)."""
        if self.decoding.pop(req.kv_id, None) is None:
            return
        self.model_streams[req.model_worker].released()
        if rebuild_why is not None and req.status is not Status.FINISHED:
            self._start_recovery(req, stage, rebuild_why)
        else:
            await self._free_kv(req)

    async def _accept_token(self, req: Request, token: int, logprobs: lamina_pb2.Logprobs | None = None,
                            prompt_logprobs: Sequence[lamina_pb2.Logprobs] = ()) -> None:
        req.output_ids.append(token)
        self.journal.generated(req.request_id, token)
        reason = stop_reason(req.params, token, len(req.output_ids), req.num_tokens, self.eos_ids,
                             self.max_model_len)
        req.events.put_nowait(lamina_pb2.TokenChunk(token_ids=[token], finish_reason=reason or "",
                                                    logprobs=[logprobs] if logprobs is not None else [],
                                                    prompt_logprobs=prompt_logprobs, index=req.index))
        if reason is not None:
            await self._finish(req, reason, notify=False)

    async def _finish(self, req: Request, reason: str, notify: bool = True) -> None:
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
        if req.kv_id in self.decoding:
            # A step of it may be in flight: its KV is freed once the model worker lets go.
            self.model_streams[req.model_worker].leave([req.kv_id])
        elif was_placed:
            await self._free_kv(req)
        self._wake_admit.set()
        self._update_gauges()

    async def _free_kv(self, req: Request) -> None:
        self._release(req)
        workers, req.workers = req.workers, []
        await self._free_seqs(workers, [req.kv_id])
        with contextlib.suppress(Exception):
            await self.runtime.store.delete_placement(req.request_id)
        self._wake_admit.set()

    async def _free_seqs(self, workers: Sequence[int], seq_ids: list[str]) -> None:
        results = await asyncio.gather(*(self.attention_stubs[w].Free(
            lamina_pb2.FreeRequest(seq_ids=seq_ids), timeout=self.config.deadlines.health_s)
            for w in workers), return_exceptions=True)
        for w, r in zip(workers, results):
            if isinstance(r, BaseException):  # freed once the worker answers again (_probe_attention)
                self._orphans.setdefault(w, set()).update(seq_ids)

    def _release(self, req: Request) -> None:
        for w in req.workers:
            self.reserved_tokens[w] -= req.reserved
        req.reserved = 0

    # -- recovery ---------------------------------------------------------------------------
    async def _republish(self, store) -> None:
        """The metadata store lost everything (Redis restarted without persistence):
        write the placement and journal entry of every request still here again."""
        for req in list(self.by_id.values()):
            self.journal.restore(req.request_id, req.prompt_ids, req.params, req.output_ids)
            if req.workers:
                await store.set_placement(req.request_id, self._placement_of(req))
        log.info("republished %d request(s) to a restarted metadata store", len(self.by_id))

    async def _end_orphans(self) -> None:
        """Requests a previous scheduler left behind (it died: their clients' streams
        ended with it): free their KV on every attention worker and drop their
        placements and journal entries, so the stack starts consistent."""
        store = self.runtime.store
        entries = await store.read_journal()
        ids = sorted({e.request_id for e in entries} | await store.placed_requests())
        if not ids:
            return
        log.warning("freeing %d request(s) left by a previous scheduler", len(ids))
        kv_ids = [kv_id(rid, n) for rid in ids for n in range(_MAX_RECOVERIES + 1)]
        await asyncio.gather(*(stub.Free(lamina_pb2.FreeRequest(seq_ids=kv_ids), timeout=self.config.deadlines.rpc_s)
                               for stub in self.attention_stubs if stub is not None), return_exceptions=True)
        await store.write_journal([], {}, ids)
        for rid in ids:
            await store.delete_placement(rid)

    def _own(self, coro, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._recoveries.add(task)
        task.add_done_callback(self._recoveries.discard)

    def _start_recovery(self, req: Request, stage: str, cause: str) -> None:
        req.status = Status.RECOVERING
        self.m_recovered.labels(stage).inc()
        log.warning("rebuilding %s (%s failed: %s)", req.request_id, stage, cause)
        self._own(self._recover(req, cause), f"recover-{req.request_id}")

    async def _recover(self, req: Request, cause: str) -> None:
        """Free what the request holds, then place and prefill it again until that works,
        it is aborted, or the recovery deadline passes."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.deadlines.recovery_s
        delay = 0.1
        try:
            await self._free_kv(req)
            # A new KV id: frames of the old one still on their way (from a worker that
            # was only stopped and resumes) find no sequence instead of corrupting this one.
            req.recoveries += 1
            while True:
                if req.abort_requested or req.status is Status.FINISHED:
                    await self._finish(req, "abort")
                    return
                if req.recoveries > _MAX_RECOVERIES:
                    await self._fail(req, f"its KV was lost {req.recoveries} times; last cause: {cause}")
                    return
                try:
                    await self._rebuild(req)
                    return
                except _NotYet as exc:
                    cause = str(exc)
                if loop.time() + delay > deadline:
                    await self._fail(req, f"no attention and prefill workers available within "
                                          f"{self.config.deadlines.recovery_s:g} s ({cause})")
                    return
                await asyncio.sleep(delay)
                delay = min(2 * delay, 2.0)
        except Exception:  # noqa: BLE001 - a request must end, never wait on a dead task
            log.exception("rebuilding %s failed", req.request_id)
            await self._fail(req, "internal error while rebuilding its KV")

    async def _fail(self, req: Request, message: str) -> None:
        log.error("request %s ends: %s", req.request_id, message)
        req.events.put_nowait(RequestFailed(message))
        await self._finish(req, "error", notify=False)

    async def _rebuild(self, req: Request) -> None:
        """One attempt: place on healthy workers, recompute the KV, rejoin decode."""
        healthy = await self._probe_attention()
        capacity = [c if ok else 0 for c, ok in zip(self._placeable(), healthy)]
        if not self._place(req, capacity):
            down = [w for w, ok in enumerate(healthy) if not ok]
            raise _NotYet(f"attention worker(s) {down} down and no other with room")
        workers = req.workers
        first = not req.output_ids  # failed during its first prefill: that one samples the first token
        try:
            result = await self._prefill_call(req, req.rebuild_ids)
        except _NotYet:
            await self._free_kv(req)
            raise
        except grpc.aio.AioRpcError as exc:
            await self._free_kv(req)
            if exc.code() not in _PEER_FAILURES and exc.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            await self.prefills.refresh()
            raise _NotYet(f"prefill: {exc.code().name}: {exc.details()}") from None
        log.info("%s rebuilt on attention worker(s) %s (%d tokens)", req.request_id, workers, len(req.rebuild_ids))
        if req.abort_requested:
            await self._finish(req, "abort")
            return
        if first:
            if not await self._start_choices(req, result):
                return
            await self._accept_token(req, result.token_id, logprobs_of(result), result.prompt_logprobs)
            if req.status is Status.FINISHED:
                return
        self._join_decode(req)
        self._update_gauges()

    async def _probe_attention(self) -> list[bool]:
        """Which attention workers answer now. Re-reads their registrations, so a
        restarted worker is reached at its new address; frees orphans on those that answer."""
        d = self.config.deadlines
        with contextlib.suppress(Exception):
            for info in await self.runtime.store.list_services("attention"):
                w = worker_index(info.service_id)
                if w is not None and w < len(self.attention_stubs) and self.attention_stubs[w] is not None \
                        and info.meta.get("grpc") != self._attention_grpc[w]:
                    self._attention_grpc[w] = info.meta["grpc"]
                    self.attention_stubs[w] = lamina_pb2_grpc.AttentionControlStub(self._channel(info.meta["grpc"]))
        stats = await asyncio.gather(*(stub.Stats(lamina_pb2.Empty(), timeout=d.health_s) if stub is not None
                                       else _no_worker(w) for w, stub in enumerate(self.attention_stubs)),
                                     return_exceptions=True)
        healthy = []
        for w, st in enumerate(stats):
            ok = not isinstance(st, BaseException)
            if ok and self._orphans.get(w):
                seq_ids = sorted(self._orphans[w])
                try:
                    await self.attention_stubs[w].Free(lamina_pb2.FreeRequest(seq_ids=seq_ids), timeout=d.health_s)
                    self._orphans[w].difference_update(seq_ids)
                except grpc.aio.AioRpcError:
                    ok = False
            healthy.append(ok)
        return healthy

    async def _refresh_attention(self) -> None:
        """Bring the pool in line with the registered attention workers: one that
        registered (a new index up to attention.max_workers, or a left one back) joins
        once it answers Stats, one whose registration is gone leaves (its requests stay
        until a step to it fails; then they are rebuilt like any worker's)."""
        infos = await self.runtime.store.list_services("attention")
        present = {w: a for w, a in enumerate(self._attention_grpc) if w not in self._attention_left}
        change = membership(present, [(i.service_id, i.meta.get("grpc", "")) for i in infos],
                            self.config.attention.pool_limit)
        for w in sorted(change.left):
            self._attention_left.add(w)
            log.info("attention worker %d left the pool (its registration ended)", w)
        for w, address in change.joined.items():
            try:
                await self._join_attention(w, address, self.config.deadlines.health_s)
            except grpc.aio.AioRpcError as exc:
                log.info("attention worker %d at %s registered but does not answer yet (%s)", w, address,
                         exc.code().name)
                continue
            log.info("attention worker %d is in the pool at %s (%d tokens of KV)", w, address,
                     self.capacity_tokens[w])

    async def _join_attention(self, w: int, address: str, timeout_s: float) -> None:
        """Put attention worker `w`, at gRPC `address`, in the pool with the KV capacity
        it reports; raises the Stats call's error when it does not answer."""
        stub = lamina_pb2_grpc.AttentionControlStub(self._channel(address))
        stats = await stub.Stats(lamina_pb2.Empty(), timeout=timeout_s)
        self._grow_attention(w + 1)
        self.attention_stubs[w], self._attention_grpc[w] = stub, address
        self.capacity_tokens[w] = stats.capacity_tokens
        self._attention_left.discard(w)

    def _grow_attention(self, size: int) -> None:
        """Room for attention workers up to index `size - 1`; a new slot has left the
        pool until its worker joins."""
        while len(self.attention_stubs) < size:
            self._attention_left.add(len(self.attention_stubs))
            self.attention_stubs.append(None)
            self._attention_grpc.append("")
            self.capacity_tokens.append(0)
            self.reserved_tokens.append(0)

    def _channel(self, address: str) -> grpc.aio.Channel:
        """A channel to a service of the stack, closed with the scheduler."""
        channel = open_channel(address, self.config.cluster_token)
        self._channels.append(channel)
        return channel

    async def _watch_model_workers(self) -> None:
        """A model worker that holds sequences and sends no step result for
        `deadlines.step_s` (hung, e.g. stopped) is treated as lost: its requests are
        rebuilt elsewhere and its stream is opened anew once it answers."""
        limit = self.config.deadlines.step_s
        while True:
            await asyncio.sleep(min(1.0, limit / 4))
            now = time.monotonic()
            for w, stream in enumerate(self.model_streams):
                if stream.alive and stream.stalled_for(now) > limit:
                    stream.alive = False
                    await stream.close()
                    await self._on_decode_lost(w, f"no step result for {limit:g} s")

    async def _reopen_model_stream(self, worker: int) -> None:
        """Open a new decode stream to model worker `worker` once it is registered and
        serving again (backing off while it is not), then hand it the parked requests."""
        old = self.model_streams[worker]
        delay = 0.25
        while True:
            await asyncio.sleep(delay)
            delay = min(2 * delay, 4.0)
            info = await self.runtime.store.get_service("model", f"model-{worker}")
            raise_if_cancelled()
            if info is None:
                continue
            channel = open_channel(info.endpoint, self.config.cluster_token)
            try:
                await asyncio.wait_for(channel.channel_ready(), self.config.deadlines.health_s)
            except asyncio.TimeoutError:
                await channel.close()
                continue
            self._channels.append(channel)
            stream = ModelStream(worker, lamina_pb2_grpc.ModelWorkerStub(channel), self._stop_rule,
                                 self._on_decode_result, self._on_decode_lost)
            await old.close()
            self.model_streams[worker] = stream
            stream.open()
            log.info("decode stream of model worker %d open again at %s", worker, info.endpoint)
            parked, self._parked = self._parked, []
            for req in parked:
                if req.status is Status.RECOVERING and not req.abort_requested:
                    self._join_decode(req)
                else:
                    await self._finish(req, "abort")
            return

    async def _publish_placement_tokens(self) -> None:
        """Keep each placement's token counts current: every _PLACEMENT_TOKENS_S, one
        write of every request whose KV is in place (decoding, or parked for a model
        worker), when anything changed; not a Redis round trip per token."""
        written: dict[str, dict[str, int]] = {}
        while True:
            await asyncio.sleep(_PLACEMENT_TOKENS_S)  # a periodic timer: the counts grow every step
            held = {r.request_id: {f"attention-{w}": len(r.rebuild_ids) for w in r.workers}
                    for r in [*self.decoding.values(), *self._parked] if r.workers}
            if held == written:
                continue
            try:
                await self.runtime.store.update_placement_tokens(held)
                written = held
            except REDIS_ERRORS as exc:
                log.debug("placement tokens not written (%s)", exc)
            raise_if_cancelled()

    def _update_gauges(self) -> None:
        self.m_waiting.set(len(self.waiting))
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
        self._channels = []
        self._grow_attention(ac.workers)  # the slots of workers not registered yet: joined by the watcher
        for w, address in registered.items():
            await self._join_attention(w, address, self.config.deadlines.rpc_s)
        self.prefills.connect(prefills)
        model_channels = [self._channel(m.endpoint) for m in models]
        stop = self._stop_rule = lamina_pb2.StopRule(eos_token_ids=sorted(self.eos_ids),
                                                     max_model_len=self.max_model_len)
        self.model_streams = [ModelStream(i, lamina_pb2_grpc.ModelWorkerStub(c), stop, self._on_decode_result,
                                          self._on_decode_lost) for i, c in enumerate(model_channels)]
        await self._end_orphans()
        for m in self.model_streams:
            m.open()
        self.journal.start()
        self._tasks = [asyncio.create_task(self._admit_loop(), name="admit"),
                       asyncio.create_task(self._watch_model_workers(), name="model-watchdog"),
                       asyncio.create_task(self._publish_placement_tokens(), name="placement-tokens"),
                       asyncio.create_task(self.prefills.watch(), name="prefill-watch")]
        if self.config.attention.pool_limit > self.config.attention.workers:
            self._tasks.append(asyncio.create_task(
                refresh_every_half_ttl(store, self._refresh_attention, "attention workers"), name="attention-watch"))
        try:
            await rt.serve(lambda s: lamina_pb2_grpc.add_SchedulerServicer_to_server(_SchedulerServicer(self), s),
                           rebuild=self._republish)
        finally:
            await stack_dumps.cancel_and_wait([*self._tasks, *self._prefills, *self._recoveries])
            await asyncio.gather(*(m.close() for m in self.model_streams), return_exceptions=True)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.journal.close(), self.config.deadlines.health_s)
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

    async def Abort(self, request, context):  # noqa: N802
        await self.s.abort(request.request_id, request.choice if request.HasField("choice") else None)
        return lamina_pb2.Empty()

    async def Stats(self, request, context):  # noqa: N802
        s = self.s
        return lamina_pb2.SchedulerStats(
            num_waiting=len(s.waiting), num_running=len(s.running) + s.num_prefilling, num_steps=s.num_steps,
            mean_batch_size=s.sum_batch / s.num_steps if s.num_steps else 0.0, max_queue=s.limits.max_queue)


def _with_seed(params: lamina_pb2.SamplingParams, seed: int) -> lamina_pb2.SamplingParams:
    out = lamina_pb2.SamplingParams()
    out.CopyFrom(params)
    out.seed = seed
    return out


def serve(config: StackConfig) -> None:
    torch.set_num_threads(1)
    from lamina import transports

    transports.install_uvloop()
    asyncio.run(SchedulerService(config).run())


async def _no_worker(w: int) -> None:
    """Stats of a pool slot with no worker: fails like an unreachable one."""
    raise ConnectionError(f"attention worker {w} has not joined the pool")
