"""Decode: the scheduler's side of the model workers' decode streams.

`DecodeStreams` owns one `ModelStream` per model worker (lamina.services.scheduler.model_streams),
the requests a model worker holds (`decoding`, by KV id: joined and not yet released),
the requests whose KV is in place while no model worker is live (`parked`), the step
counts reported by Stats, and the tasks that open a lost worker's stream again. It
sends only joins and leaves; a model worker steps its sequences in staggered
micro-batches and streams their tokens back (`on_result`). Where a request joins is a
pure decision: the least loaded live worker (`micro_batches.join_target`), or under
rotational pipelining the coordinator's (`rotation.coordinator`).

What must hold:
- A request is in `decoding` from its join until its model worker releases it (a stop
  rule, a leave, a failure); only then is its KV freed, so no step in flight ever
  writes into freed KV.
- A model worker whose stream broke, or that holds sequences and sends no step result
  for `deadlines.step_s` (hung), is lost: each of its requests is rebuilt whole (a step
  may have written part of a token's KV), and its stream is opened anew once it answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc

from lamina.kvstore.metadata import REDIS_ERRORS
from lamina.services.channels import open_channel
from lamina.services.model.micro_batches import join_target
from lamina.services.model.rotation import coordinator
from lamina.services.protos import lamina_pb2, lamina_pb2_grpc
from lamina.services.sampling_wire import join_history, logprobs_of
from lamina.services.scheduler.join_hold import holds_join
from lamina.services.scheduler.model_streams import ModelStream
from lamina.services.scheduler.scheduler_state import Request, Status

if TYPE_CHECKING:
    from lamina.services.scheduler.scheduler_service import SchedulerService

log = logging.getLogger(__name__)

# How often the tokens each placed request holds are written to its placement.
PLACEMENT_TOKENS_S = 0.5


class DecodeStreams:
    def __init__(self, scheduler: SchedulerService, stop: lamina_pb2.StopRule) -> None:
        self._s = scheduler
        self._stop = stop  # sent first on every stream: the model workers end sequences by it
        self.streams: list[ModelStream] = []  # by model worker; opened by open()
        self.decoding: dict[str, Request] = {}  # held by a model worker (joined, not yet released)
        self.parked: list[Request] = []  # KV in place, waiting for a live model worker
        # Prefilled, waiting to join an idle model worker together (lamina.services.scheduler.join_hold).
        self.held: list[Request] = []
        self.shares_host: list[bool] = []  # by model worker: a prefill worker runs on its host
        self._hold_timer: asyncio.TimerHandle | None = None
        self.num_steps = 0
        self.sum_batch = 0
        self._reopenings: set[asyncio.Task[None]] = set()  # owned: cancelled at shutdown

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        """The stream reopenings in flight (to cancel at shutdown)."""
        return list(self._reopenings)

    def open(self, channels: Sequence[grpc.aio.Channel], shares_host: Sequence[bool] = ()) -> None:
        """Open a decode stream on each model worker's channel (index order);
        `shares_host`: by worker, whether a prefill worker runs on its host."""
        self.streams = [self._stream(i, channel) for i, channel in enumerate(channels)]
        self.shares_host = [bool(x) for x in shares_host] or [False] * len(channels)
        for stream in self.streams:
            stream.open()

    def _stream(self, worker: int, channel: grpc.aio.Channel) -> ModelStream:
        return ModelStream(worker, lamina_pb2_grpc.ModelWorkerStub(channel), self._stop, self.on_result,
                           self.on_lost)

    async def close(self) -> None:
        if self._hold_timer is not None:
            self._hold_timer.cancel()
        await asyncio.gather(*(m.close() for m in self.streams), return_exceptions=True)

    # -- joins and leaves -------------------------------------------------------------------
    def join(self, req: Request) -> None:
        """Hand a prefilled request to the least loaded live model worker's decode
        stream (rotational: the coordinator's, lamina.services.model.rotation; colocated: the
        one whose process holds its KV); with none live, it waits (KV in place) for one to
        come back. A request for an idle model worker may wait first for the others
        prefilling on its host (`held`, lamina.services.scheduler.join_hold); the last of
        them to come takes the waiting ones along."""
        if req not in self._s.running:
            self._s.running.append(req)
        req.status = Status.RUNNING  # held, an abort finishes it as any running one (no worker holds it yet)
        self.held.append(req)
        w = self._target(req, {})
        hold_s = self._s.config.scheduler.join_hold_ms / 1000
        if w is not None and holds_join(self.streams[w].num_sequences, self._s.admission.num_prefilling,
                                        self.shares_host[w], hold_s):
            if self._hold_timer is None:
                self._hold_timer = asyncio.get_running_loop().call_later(hold_s, self.release_held)
            self._s.m_held.inc()
            return
        self.release_held()

    def release_held(self) -> None:
        """Join the requests held for an idle worker (their wait is over: the prefills
        they waited for ended, or `scheduler.join_hold_ms` passed). Each worker's joins
        go in one update, so that its first step takes them all."""
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        held, self.held = self.held, []
        joining: dict[int, list[Request]] = {}
        for req in held:
            if req.status is not Status.RUNNING or req.abort_requested:
                continue  # aborted while it waited (finish freed its KV)
            w = self._target(req, {i: len(reqs) for i, reqs in joining.items()})
            if w is None:
                req.status = Status.RECOVERING
                self.parked.append(req)
                continue
            req.model_worker = w
            self.decoding[req.kv_id] = req
            joining.setdefault(w, []).append(req)
        for w, reqs in joining.items():
            self.streams[w].join([self._step_sequence(r) for r in reqs])

    def _target(self, req: Request, joining: dict[int, int]) -> int | None:
        """The live model worker `req` joins, `joining[i]` more sequences counted on
        worker i (None: none is live)."""
        config = self._s.config
        live = [i for i, m in enumerate(self.streams) if m.alive]
        if config.colocated:
            live = [i for i in live if i == req.workers[0]]
        if not live:
            return None
        loads = [self.streams[i].num_sequences + joining.get(i, 0) for i in live]
        return live[coordinator(loads) if config.rotational else join_target(loads)]

    @staticmethod
    def _step_sequence(req: Request) -> lamina_pb2.StepSequence:
        return lamina_pb2.StepSequence(
            seq_id=req.kv_id, token_id=req.output_ids[-1], position=req.num_tokens - 1, params=req.params,
            output_index=len(req.output_ids), placement=lamina_pb2.Placement(workers=req.workers),
            **join_history(req.params, req.prompt_ids, req.output_ids))

    def leave(self, req: Request) -> bool:
        """Tell `req`'s model worker to drop it; False when no model worker holds it.
        Its KV is freed once the worker lets go (`released`): a step of it may be in flight."""
        if req.kv_id not in self.decoding:
            return False
        self.streams[req.model_worker].leave([req.kv_id])
        return True

    def unpark(self, req: Request) -> bool:
        """Take `req` from those waiting for a model worker; False when it is not one."""
        if req not in self.parked:
            return False
        self.parked.remove(req)
        return True

    async def released(self, req: Request, rebuild_why: str | None = None, stage: str = "decode") -> None:
        """The model worker holds `req` no more: no frame of it is in flight, its KV can go.

        With `rebuild_why` (its step failed, or its worker was lost), a request that has
        not finished is rebuilt instead (which frees its KV first)."""
        if self.decoding.pop(req.kv_id, None) is None:
            return
        self.streams[req.model_worker].released()
        if rebuild_why is not None and req.status is not Status.FINISHED:
            self._s.recovery.start(req, stage, rebuild_why)
        else:
            await self._s.free_kv(req)

    # -- what the model workers report ------------------------------------------------------
    async def on_result(self, worker: int, result: lamina_pb2.DecodeResult) -> None:
        s = self._s
        if result.tokens:
            self.num_steps += 1
            self.sum_batch += len(result.tokens)
        for t in result.tokens:
            req = self.decoding.get(t.seq_id)
            if req is None:
                continue
            if req.status is not Status.FINISHED:
                await s.accept_token(req, t.token_id, logprobs_of(t))
            if t.finished:
                if req.status is not Status.FINISHED:
                    # Both sides end a sequence by stop_reason: this would be a bug, not a race.
                    log.error("model worker %d ended %s, which the scheduler would continue", worker, t.seq_id)
                    await s.finish(req, "abort")
                await self.released(req)
        for sid in result.left:
            req = self.decoding.get(sid)
            if req is not None:
                await self.released(req)
        for f in result.failed:
            req = self.decoding.get(f.seq_id)
            if req is None:
                continue
            # The model worker dropped it: no frame of it is in flight any more.
            await self.released(req, rebuild_why=f"model worker {worker}: {f.code}: {f.message}")

    async def on_lost(self, worker: int, error: str) -> None:
        stream = self.streams[worker]
        stream.alive = False
        reqs = [r for r in self.decoding.values() if r.model_worker == worker]
        log.error("decode stream of model worker %d lost (%s); rebuilding its %d requests elsewhere",
                  worker, error, len(reqs))
        for req in reqs:
            # The worker is gone or its stream is: a step of these may have written part
            # of a token's KV, so each is rebuilt whole.
            await self.released(req, rebuild_why=f"model worker {worker}: {error}", stage="model")
        task = asyncio.create_task(self._reopen(worker), name=f"reopen-model-{worker}")
        self._reopenings.add(task)
        task.add_done_callback(self._reopenings.discard)

    # -- loops ------------------------------------------------------------------------------
    async def watch(self) -> None:
        """A model worker that holds sequences and sends no step result for
        `deadlines.step_s` (hung, e.g. stopped) is treated as lost: its requests are
        rebuilt elsewhere and its stream is opened anew once it answers."""
        limit = self._s.config.deadlines.step_s
        while True:
            await asyncio.sleep(min(1.0, limit / 4))
            now = time.monotonic()
            for w, stream in enumerate(self.streams):
                if stream.alive and stream.stalled_for(now) > limit:
                    stream.alive = False
                    await stream.close()
                    await self.on_lost(w, f"no step result for {limit:g} s")

    async def _reopen(self, worker: int) -> None:
        """Open a new decode stream to model worker `worker` once it is registered and
        serving again (backing off while it is not), then hand it the parked requests."""
        s = self._s
        old = self.streams[worker]
        delay = 0.25
        while True:
            await asyncio.sleep(delay)
            delay = min(2 * delay, 4.0)
            info = await s.runtime.store.get_service("model", f"model-{worker}")
            if info is None:
                continue
            channel = open_channel(info.endpoint, s.config.cluster_token)
            try:
                await asyncio.wait_for(channel.channel_ready(), s.config.deadlines.health_s)
            except TimeoutError:
                await channel.close()
                continue
            s.channels.replace(("model", info.service_id), channel)  # the old one closes after its grace
            stream = self._stream(worker, channel)
            await old.close()
            self.streams[worker] = stream
            stream.open()
            log.info("decode stream of model worker %d open again at %s", worker, info.endpoint)
            parked, self.parked = self.parked, []
            for req in parked:
                if req.status is Status.RECOVERING and not req.abort_requested:
                    self.join(req)
                else:
                    await s.finish(req, "abort")
            return

    async def publish_placement_tokens(self) -> None:
        """Keep each placement's token counts current: every PLACEMENT_TOKENS_S, one
        write of every request whose KV is in place (decoding, or parked for a model
        worker), when anything changed; not a Redis round trip per token."""
        written: dict[str, dict[str, int]] = {}
        while True:
            await asyncio.sleep(PLACEMENT_TOKENS_S)  # a periodic timer: the counts grow every step
            held = {r.request_id: {f"attention-{w}": len(r.rebuild_ids) for w in r.workers}
                    for r in [*self.decoding.values(), *self.parked, *self.held] if r.workers}
            if held == written:
                continue
            try:
                await self._s.runtime.store.update_placement_tokens(held)
                written = held
            except REDIS_ERRORS as exc:
                log.debug("placement tokens not written (%s)", exc)
