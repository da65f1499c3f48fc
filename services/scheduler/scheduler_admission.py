"""Admission: the waiting queue, the order it is admitted in, the prefill slots, and
each admitted request's first prefill.

`Admission` owns the waiting queue (arrival order), the count of sequences whose
prefill is in flight (`num_prefilling`), the event that wakes its loop, and the
prefill tasks (cancelled at shutdown). What it decides is pure: the order is
`scheduler_state.admission_order` over `scheduling_policies` (FCFS, Fastest-Prefix-First,
Relaxed-FPF), room in the decode batch `scheduler_state.can_admit`, and where a
request's KV goes the attention pool's `place`.

What must hold:
- A request is in `waiting` only while its status is WAITING.
- `num_prefilling` counts a slot per choice of every request whose prefill call is in
  flight: added when its prefill starts, given back exactly once when the call ends,
  however it ends. Admission counts these with the running requests against
  `scheduler.max_batch_size`.
- A request is placed (room for its KV reserved on attention workers) before a prefill
  worker writes its KV there.
- Whatever frees a prefill slot or KV room calls `wake()`; the loop sleeps otherwise.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import TYPE_CHECKING

import grpc

from lamina.services.protos import lamina_pb2
from lamina.services.sampling_wire import logprobs_of
from lamina.services.scheduler.scheduler_state import NotYet, Request, Status, admission_order, can_admit

if TYPE_CHECKING:
    from lamina.services.scheduler.scheduler_service import SchedulerService

log = logging.getLogger(__name__)

# Waiting requests a prefix-aware policy considers at each admission.
POLICY_WINDOW = 32
# gRPC codes of a peer that is gone, restarting or not answering: worth a rebuild.
PEER_FAILURES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                 grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)


class Admission:
    def __init__(self, scheduler: SchedulerService) -> None:
        self._s = scheduler
        self.waiting: deque[Request] = deque()
        self.num_prefilling = 0  # decode slots (one per choice) of the requests prefilling
        self._wake = asyncio.Event()
        self._prefills: set[asyncio.Task[None]] = set()  # owned: cancelled at shutdown

    @property
    def is_full(self) -> bool:
        return len(self.waiting) >= self._s.limits.max_queue

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        """The prefills in flight (to cancel at shutdown)."""
        return list(self._prefills)

    def enqueue(self, req: Request) -> None:
        self.waiting.append(req)
        self.wake()

    def wake(self) -> None:
        """Room may have come free (a prefill slot, KV): look at the queue again."""
        self._wake.set()

    async def run(self) -> None:
        """Admit waiting requests while there is room, for as long as the scheduler runs."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.waiting and self._room_for(None):
                # One ordering per window, then as many admissions as there is room for:
                # asking the prefill service per admission would wait behind its running
                # forward each time, and prompts could not gather for a shared forward.
                admitted = 0
                for req in await self._order():
                    if not self._room_for(req):
                        break
                    if req not in self.waiting:
                        continue  # aborted while the order was computed
                    if not self._s.attention.place(req):
                        break  # no KV room until a running request finishes (which wakes this loop)
                    self.waiting.remove(req)
                    self.start_prefill(req)
                    admitted += 1
                if not admitted:
                    break

    def _room_for(self, req: Request | None) -> bool:
        """Room in the decode batch for `req`'s choices (for one sequence when None)."""
        return can_admit(len(self._s.running), self.num_prefilling, self._s.limits.max_batch_size,
                         req.num_slots if req is not None else 1)

    async def _order(self) -> list[Request]:
        """The first `POLICY_WINDOW` waiting requests in the order to admit them: arrival
        order for FCFS; the prefix-aware policies order them by cached-prefix tier
        distance (asked of the prefill workers once per window; a prompt's distance is
        the nearest tier any of them holds its prefix in)."""
        window = list(self.waiting)[:POLICY_WINDOW]
        if self._s.limits.policy == "fcfs":
            return window
        distances = await self._s.prefills.tier_distances([r.prompt_ids for r in window])
        if distances is None:
            return window
        return admission_order(window, distances, self._s.limits.policy, time.monotonic())

    def start_prefill(self, req: Request) -> None:
        """Start the first prefill of a placed request."""
        # Prefills run concurrently (the prefill service batches those that wait
        # together); counted as prefilling from here, so admission sees them.
        req.status = Status.PREFILLING
        self.num_prefilling += req.num_slots
        task = asyncio.create_task(self._prefill(req), name=f"prefill-{req.request_id}")
        self._prefills.add(task)
        task.add_done_callback(self._prefills.discard)

    async def _prefill(self, req: Request) -> None:
        try:
            await self._run_prefill(req)
        except Exception:  # e.g. the metadata store failed: this request ends, the others go on
            log.exception("prefill of %s failed", req.request_id)
            if req.status is Status.PREFILLING:  # (no longer counted as prefilling: _run_prefill)
                await self._s.finish(req, "abort")
        finally:
            if not self.num_prefilling and self._s.decode.held:
                self._s.decode.release_held()  # no prefill in flight: those held wait for none now
            self.wake()  # a prefill slot is free again

    async def _run_prefill(self, req: Request) -> None:
        s = self._s
        try:
            try:
                result = await self.prefill_call(req, req.prompt_ids)
            finally:  # counted as prefilling until the call ends, however it ends: exactly once
                self.num_prefilling -= req.num_slots
        except NotYet as exc:  # no prefill worker alive: wait for one as a rebuild does
            s.running.append(req)
            s.recovery.start(req, "prefill", str(exc))
            return
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and (s.running or self.num_prefilling):
                # KV memory is full after all: retry once running (or other prefilling)
                # requests have freed some.
                s.attention.release(req)
                req.workers = []
                req.status = Status.WAITING
                self.waiting.appendleft(req)
                return
            if exc.code() in PEER_FAILURES:
                # A worker died or stopped answering: place it again and prefill anew.
                s.running.append(req)
                s.recovery.start(req, "prefill", f"{exc.code().name}: {exc.details()}")
                return
            log.warning("prefill of %s failed: %s", req.request_id, exc.details())
            await s.finish(req, "abort")
            return
        if not await s.start_choices(req, result):
            return
        await s.accept_token(req, result.token_id, logprobs_of(result), result.prompt_logprobs,
                             result.cached_tokens)
        if req.status is not Status.FINISHED:
            if req.abort_requested:
                await s.finish(req, "abort")
            else:
                s.decode.join(req)
        s.update_gauges()

    async def prefill_call(self, req: Request, token_ids: list[int]) -> lamina_pb2.PrefillResult:
        """Record the placement and have a prefill worker (the one the routing picks)
        compute `token_ids`' KV on it; NotYet when no prefill worker is alive.

        The record is for observers (lamina status) and for cleaning up after a failed
        scheduler; with the metadata store unreachable the request still runs, and its
        placement is written again when the store is back (`Recovery.republish`)."""
        prefills = self._s.prefills
        route = await prefills.route(token_ids)
        if route is None:
            raise NotYet("no prefill worker answers")
        worker, cached_tokens, fetch = route
        await self._s.record_placement(req)
        return await prefills.prefill(worker, lamina_pb2.PrefillRequest(
            seq_id=req.kv_id, token_ids=token_ids, params=req.params,
            placement=lamina_pb2.Placement(workers=req.workers),
            prompt_logprobs=req.prompt_logprobs and not req.output_ids,
            choice_seeds=[] if req.forked else req.choice_seeds,
            peer=prefills.peer_prefix(fetch) if fetch is not None else None), cached_tokens)
