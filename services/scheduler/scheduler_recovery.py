"""Recovery: rebuilding the requests a lost worker held (docs/reliability.md), and
clearing what a lost metadata store or a previous scheduler left behind.

`Recovery` owns the rebuild tasks (cancelled at shutdown) and the rebuild counter.
A rebuild frees what the request holds, probes the attention workers (a restarted one
is found anew in the metadata store), places the request on those that answer with
room, has a live prefill worker recompute the KV of the prompt and every generated
token but the newest (its prefix cache serves the prompt), then hands the request back
to decode. Sampling is seeded per output index, so the stream goes on with the tokens
it would have had.

What must hold:
- A request being rebuilt is RECOVERING and stays in the scheduler's `running` (its
  decode slot stays taken); its rebuild task is the one that ends it: an abort meanwhile
  only sets `abort_requested`, which the task honours after its call.
- Each rebuild stores the KV under a new id (`scheduler_state.kv_id`), so frames still
  addressed to the old one (from a worker that was only stopped and resumes) find no
  sequence instead of corrupting this one.
- A rebuild ends: rebuilt, aborted, or failed with an error (its KV lost more than
  MAX_RECOVERIES times, or no placement within `deadlines.recovery_s`); a request never
  waits on a dead task.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import grpc
import prometheus_client

from lamina.kvstore.metadata import MetadataStore
from lamina.services.sampling_wire import logprobs_of
from lamina.services.scheduler.scheduler_admission import PEER_FAILURES
from lamina.services.scheduler.scheduler_state import NotYet, Request, RequestFailed, Status, kv_id

if TYPE_CHECKING:
    from lamina.services.scheduler.scheduler_service import SchedulerService

log = logging.getLogger(__name__)

# A request whose KV had to be rebuilt this often is failing for a reason a rebuild
# does not cure: it ends with an error.
MAX_RECOVERIES = 3


def pause_before(recovery: int) -> float:
    """Seconds a request's `recovery`-th rebuild (1, 2, ...) waits before its first
    attempt: none for the first; a request lost again soon after a rebuild waits 0.25 s,
    then 0.5 s, so that a passing cause (a worker renewing its registration, a link
    coming back) has time to pass before the rebuilds run out."""
    return 0.0 if recovery <= 1 else min(0.25 * 2 ** (recovery - 2), 2.0)


class Recovery:
    def __init__(self, scheduler: SchedulerService, registry: prometheus_client.CollectorRegistry) -> None:
        self._s = scheduler
        self._tasks: set[asyncio.Task[None]] = set()  # owned: cancelled at shutdown
        self.m_rebuilds = prometheus_client.Counter(
            "lamina_scheduler_rebuilds", "requests whose KV was rebuilt after a worker failed", ["stage"],
            registry=registry)

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        """The rebuilds in flight (to cancel at shutdown)."""
        return list(self._tasks)

    def start(self, req: Request, stage: str, cause: str) -> None:
        """Rebuild `req`, whose `stage` (prefill, fork, decode, model) failed for `cause`."""
        req.status = Status.RECOVERING
        self.m_rebuilds.labels(stage).inc()
        log.warning("rebuilding %s (%s failed: %s)", req.request_id, stage, cause)
        self._own(self._recover(req, cause), f"recover-{req.request_id}")

    def _own(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _recover(self, req: Request, cause: str) -> None:
        """Free what the request holds, then place and prefill it again until that works,
        it is aborted, or the recovery deadline passes."""
        s = self._s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + s.config.deadlines.recovery_s
        delay = 0.1
        try:
            await s.free_kv(req)
            # A new KV id: frames of the old one still on their way (from a worker that
            # was only stopped and resumes) find no sequence instead of corrupting this one.
            req.recoveries += 1
            if req.recoveries <= MAX_RECOVERIES:
                await asyncio.sleep(pause_before(req.recoveries))
            while True:
                if req.abort_requested or req.status is Status.FINISHED:
                    await s.finish(req, "abort")
                    return
                if req.recoveries > MAX_RECOVERIES:
                    await self.fail(req, f"its KV was lost {req.recoveries} times; last cause: {cause}")
                    return
                try:
                    await self._rebuild(req)
                    return
                except NotYet as exc:
                    cause = str(exc)
                if loop.time() + delay > deadline:
                    await self.fail(req, f"no attention and prefill workers available within "
                                         f"{s.config.deadlines.recovery_s:g} s ({cause})")
                    return
                await asyncio.sleep(delay)
                delay = min(2 * delay, 2.0)
        except Exception:  # a request must end, never wait on a dead task
            log.exception("rebuilding %s failed", req.request_id)
            await self.fail(req, "internal error while rebuilding its KV")

    async def fail(self, req: Request, message: str) -> None:
        """End `req` with an error: its client's stream ends with `message`."""
        log.error("request %s ends: %s", req.request_id, message)
        req.events.put_nowait(RequestFailed(message))
        await self._s.finish(req, "error", notify=False)

    async def _rebuild(self, req: Request) -> None:
        """One attempt: place on healthy workers, recompute the KV, rejoin decode."""
        s = self._s
        healthy = await s.attention.probe()
        if not s.attention.place(req, s.attention.placeable(healthy)):
            down = [w for w, ok in enumerate(healthy) if not ok]
            raise NotYet(f"attention worker(s) {down} down and no other with room")
        workers = req.workers
        first = not req.output_ids  # failed during its first prefill: that one samples the first token
        try:
            result = await s.admission.prefill_call(req, req.rebuild_ids)
        except NotYet:
            await s.free_kv(req)
            raise
        except grpc.aio.AioRpcError as exc:
            await s.free_kv(req)
            if exc.code() not in PEER_FAILURES and exc.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            await s.prefills.refresh()
            raise NotYet(f"prefill: {exc.code().name}: {exc.details()}") from None
        log.info("%s rebuilt on attention worker(s) %s (%d tokens)", req.request_id, workers, len(req.rebuild_ids))
        if req.abort_requested:
            await s.finish(req, "abort")
            return
        if first:
            if not await s.start_choices(req, result):
                return
            # Its first prefill gave no result: this one's cache hit is what the prompt cost.
            await s.accept_token(req, result.token_id, logprobs_of(result), result.prompt_logprobs,
                                 result.cached_tokens)
            if req.status is Status.FINISHED:
                return
        s.decode.join(req)
        s.update_gauges()

    async def republish(self, store: MetadataStore) -> None:
        """The metadata store lost everything (Redis restarted without persistence):
        write the placement and journal entry of every request still here again."""
        s = self._s
        for req in list(s.by_id.values()):
            s.journal.restore(req.request_id, req.prompt_ids, req.params, req.output_ids)
            if req.workers:
                await store.set_placement(req.request_id, s.placement_of(req))
        log.info("republished %d request(s) to a restarted metadata store", len(s.by_id))

    async def end_leftovers(self) -> None:
        """Requests a previous scheduler left behind (it died: their clients' streams
        ended with it): free their KV on every attention worker and drop their
        placements and journal entries, so the stack starts consistent."""
        store = self._s.runtime.store
        entries = await store.read_journal()
        ids = sorted({e.request_id for e in entries} | await store.placed_requests())
        if not ids:
            return
        log.warning("freeing %d request(s) left by a previous scheduler", len(ids))
        await self._s.attention.free_everywhere([kv_id(rid, n) for rid in ids for n in range(MAX_RECOVERIES + 1)])
        await store.write_journal([], {}, ids)
        for rid in ids:
            await store.delete_placement(rid)
