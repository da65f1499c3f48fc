"""The model-slice service: holds the weights and the slices, runs decode steps.

The scheduler opens one Decode stream to each model worker and sends batch changes
on it; the worker's DecodeRunner steps its sequences in staggered micro-batches
(`StackConfig.decode_micro_batches`) and streams every step's tokens back. A step runs
slice 0, then for every layer sends Q, K, V to the attention workers holding the
micro-batch's KV and runs the next slice on their output (the split model's slice
runner, `SplitModel.run_async`); after the last slice it samples. Under
`pipeline.mode: rotational` the scheduler sends every sequence to one worker, which runs
each slice on whichever model worker is free (itself or a peer's slice service,
lamina.services.model.slice_peers), and every worker serves slices to its peers
(lamina.services.model.slice_server).

The worker keeps each decoding sequence's latest token and position (sent whole
when the sequence joins); its KV lives on the attention workers. When its stream
ends, the worker drops them all.

Under `layout: colocated` the worker runs attention worker `index` in its own process
(an `AttentionService`: registered, fed prompt KV by the prefill workers and freed by the
scheduler as any attention worker is); the scheduler decodes each sequence on the model
worker whose attention worker holds its KV, and the pool attends there by a call: a step
runs its slices and their attention in turn with no await between layers, and then waits
until the decode stream took its result (DecodeRunner's hand-off), so that gRPC sends it
at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import prometheus_client
import torch

from lamina import transports
from lamina.aio import install_uvloop
from lamina.model.batch import StepBatch
from lamina.model.llama import split_llama
from lamina.model.loader import LoadedModel, load_model
from lamina.model.placement import place, runs_natively
from lamina.model.slice_graphs import SliceGraphs
from lamina.model.splitter import Attend, SliceOutput
from lamina.model.step_graphs import SlabStepGraphs
from lamina.model.threads import set_compute_threads
from lamina.sampling.grammar import Grammars
from lamina.services.addresses import with_host
from lamina.services.attention.attention_service import AttentionService
from lamina.services.attention_pool import AttentionPool, LocalAttention, SeqRows
from lamina.services.config import PortsSection, StackConfig
from lamina.services.counter_totals import CounterTotals
from lamina.services.devices import compute_dtype, open_device
from lamina.services.model.decode_runner import DecodeRunner
from lamina.services.model.slice_peers import SliceExecutors
from lamina.services.model.slice_server import SliceServer
from lamina.services.model.staging import Staging
from lamina.services.protos import lamina_pb2, lamina_pb2_grpc
from lamina.services.runtime import ServiceRuntime
from lamina.services.warm_up import attend_own, decode_inputs, finished, graph_plan, warm_up_inputs
from lamina.services.wire import decode_tag, slice_tag
from lamina.transports.host_staging import DEVICE_WAITS

log = logging.getLogger(__name__)

# Colocated, a decode step never awaits a peer: after each one it waits until the decode
# stream took its result (DecodeRunner's hand-off), at most this long (a scheduler that
# reads slowly then holds the steps back by no more).
COLOCATED_HAND_OFF_S = 0.005


class ModelSlices:
    """The split model and how one batch runs through it with remote attention."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.cfg = self.loaded.config
        self.split = split_llama(self.loaded.model)
        self.grammars = Grammars(self.loaded.tokenizer)  # for the sequences that sample here with one
        self.compute_s = 0.0  # CPU time in the slices, every micro-batch together
        self.device = torch.device("cpu")  # where the slices compute (load() moves them)
        self.staging = Staging(self.device)  # each micro-batch's stream and pinned buffers there
        self.graphs: SliceGraphs | None = None  # the decode slices as CUDA graphs (a GPU's)
        # Whole decode steps as CUDA graphs over a colocated attention core's pools (a GPU's).
        self.step_graphs: SlabStepGraphs | None = None

    @classmethod
    def load(cls, model_path: str | None, weights: str = "float32", device: str | torch.device = "cpu",
             dtype: torch.dtype = torch.float32) -> ModelSlices:
        """The model split into slices, on `device`, its weights in `dtype`. Packed weights
        (q8_0, q4, as_file) run on CPU kernels in float32: on another device or in
        another dtype the linears are plain."""
        device = torch.device(device)
        if runs_natively(device, dtype):
            return cls(load_model(model_path, weights=weights))
        # Read in `dtype` (an 8B model read in float32 first would take twice its bytes of
        # host memory) and split on the CPU: its example inputs are there.
        slices = cls(load_model(model_path, dtype=dtype, packed=False))
        slices.device = device
        slices.staging = Staging(device)
        place([slices.loaded.model, *(piece.module for piece in slices.split.slices)], device, dtype)
        return slices

    def run_slice(self, j: int, inputs: dict, attn: torch.Tensor | None = None,
                  context: Sequence[torch.Tensor] = (), micro_batch: int | None = None) -> SliceOutput:
        """Slice j here: a micro-batch's decode slice replayed as a CUDA graph where one
        serves it (`graphs`), else eagerly. Grad mode is set per call, never held across
        an await (micro-batches interleave at the awaits)."""
        # CPU time of this thread, not wall time: on a shared host the figure stays the
        # work done, whoever else takes the core meanwhile.
        t0 = time.thread_time()
        out = None
        if self.graphs is not None and micro_batch is not None:
            out = self.graphs.run(micro_batch, j, inputs, attn, context)
        if out is None:
            with torch.inference_mode():
                out = self.split.slices[j](inputs, attn, context)
        self.compute_s += time.thread_time() - t0
        return out

    def _forward_here(self, batch: StepBatch, pool: AttentionPool, attend: Attend) -> torch.Tensor:
        """Logits [B, V] on the slices' device of a step whose attention is all in this
        process (colocated): the slices and attention called in turn, in one inference-mode
        block, with no await (no other task runs mid-step, so none sees the grad mode)."""
        t0, attending = time.thread_time(), pool.local_s
        # A GPU's decode slices replayed (colocated: one micro-batch, 0).
        call_slice = None if self.graphs is None else self.graphs.caller(0)
        with torch.inference_mode():
            # The attention core copies each layer's K and V into its slabs: the slices may
            # keep their outputs from step to step.
            logits = self.split.run(batch.model_inputs(self.device), attend, reuse_outputs=True,
                                    call_slice=call_slice)  # [B, V] float32
        # This thread's CPU time, less the attention's (counted apart by the pool).
        self.compute_s += time.thread_time() - t0 - (pool.local_s - attending)
        return logits

    def _graph_step(self, batch: StepBatch, pool: AttentionPool, core: LocalAttention,
                    members: list[tuple[str, int]]) -> torch.Tensor:
        """Logits [B, V] of a decode step replayed whole as a CUDA graph over the colocated
        core's pools (`step_graphs`): the core extends the sequences first (refusing the
        step as its attend would at layer 0), and its share of the CPU time is counted
        as attention's."""
        assert self.step_graphs is not None
        lens, slots = pool.timed(core.decode_step, members)
        t0 = time.thread_time()
        with torch.inference_mode():
            logits = self.step_graphs.run(lens, slots, batch.input_ids, batch.positions)  # [B, V] float32
        self.compute_s += time.thread_time() - t0
        return logits

    async def forward(self, micro_batch: int, step: int, batch: StepBatch, seqs: list[SeqRows],
                      pool: AttentionPool, executors: SliceExecutors | None = None) -> torch.Tensor:
        """Logits [B, V] of the batch on the slices' device, where they are sampled;
        attention runs on the pool's workers, and the slices here or, rotational, on
        whichever model worker `executors` finds free."""
        route = pool.route(seqs)
        device = self.device
        whole = self.step_graphs is not None and executors is None and self.step_graphs.serves(batch.query_lens)
        local = pool.step_here(route) if whole else None
        if local is not None:
            return self._graph_step(batch, pool, *local)
        here = pool.attend_here(route, device) if executors is None else None
        if here is not None:
            return self._forward_here(batch, pool, here)

        staging = self.staging

        async def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # Frames carry host memory (cuda_ipc: device memory): off the CPU, Q, K, V are
            # staged through pinned buffers on the micro-batch's stream and the output moved
            # back on it (on the CPU both moves return the tensors themselves).
            staged = await staging.for_frames(micro_batch, (q, k, v))
            out = await pool.attend(decode_tag(micro_batch, step, i), i, route, *staged)
            return staging.to_device(micro_batch, out)

        async def run_slice(j: int, inputs: dict[str, Any], attn: torch.Tensor | None,
                            context: Sequence[torch.Tensor]) -> SliceOutput:
            if executors is None:
                with staging.stream(micro_batch):  # no await inside: the stream is the thread's
                    return self.run_slice(j, inputs, attn, context, micro_batch)
            return await executors.run(slice_tag(micro_batch, step, j), j, inputs, attn, context)

        with staging.stream(micro_batch):
            inputs = batch.model_inputs(device)
        logits = await self.split.run_async(inputs, attend, run_slice)  # [B, V] float32
        return staging.handed_over(micro_batch, logits)


class _ModelServicer(lamina_pb2_grpc.ModelWorkerServicer):
    def __init__(self, service: ModelService) -> None:
        self.service = service

    async def Decode(self, request_iterator, context):  # noqa: N802
        async for result in self.service.decode(request_iterator):
            yield result


class ModelService:
    def __init__(self, config: StackConfig, index: int = 0) -> None:
        self.config = config
        self.index = index
        mw = config.model_worker
        device = open_device("model_worker.device", mw.device)
        self.slices = ModelSlices.load(config.model, config.weights, device, compute_dtype(mw.compute_dtype))
        # cuda_ipc carries device memory, and ucx where UCX can: Q, K, V leave from the GPU as
        # they are (a ucx connection that cannot stages them itself, after the same wait).
        device_frames = config.transport == "cuda_ipc" or (config.transport == "ucx"
                                                           and config.data_plane.ucx_device_memory)
        self.slices.staging = Staging(self.slices.device, device_frames=device_frames)
        if self.slices.device.type == "cuda" and mw.cuda_graphs:
            self.slices.graphs = SliceGraphs(self.slices.split, self.slices.device)
        self.runtime = ServiceRuntime("model", f"model-{index}", config)
        r = self.runtime.registry
        self.m_steps = prometheus_client.Counter("lamina_model_steps", "micro-batch decode steps run", registry=r)
        self.m_step_seconds = prometheus_client.Histogram("lamina_model_step_seconds",
                                                          "one micro-batch's decode step, wall time", registry=r)
        self.m_batch = prometheus_client.Histogram("lamina_model_batch_size", "sequences per micro-batch step",
                                                   buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.m_compute = prometheus_client.Counter("lamina_model_compute_seconds",
                                                   "CPU time computing the slices", registry=r)
        self.m_send = prometheus_client.Counter("lamina_model_send_seconds",
                                                "time sending Q, K, V to attention workers", registry=r)
        self.m_reply_wait = prometheus_client.Counter(
            "lamina_model_reply_wait_seconds", "time awaiting attention workers' replies, from a layer's last frame "
            "sent (summed over micro-batches)", registry=r)
        self.m_device_wait = prometheus_client.Counter(
            "lamina_model_device_wait_seconds", "time waiting for the GPU's copies before sending Q, K, V (summed "
            "over micro-batches)", registry=r)
        self.m_remote = prometheus_client.Counter("lamina_model_remote_slices",
                                                  "slices this coordinator ran on peer model workers", registry=r)
        self.m_served = prometheus_client.Counter("lamina_model_served_slices",
                                                  "slices run here for a rotational coordinator", registry=r)
        self.m_graph_replays = prometheus_client.Counter("lamina_model_graph_replays",
                                                         "decode slices replayed as CUDA graphs", registry=r)
        self.m_graph_failures = prometheus_client.Counter(
            "lamina_model_graph_capture_failures", "slices and batch buckets whose CUDA graph capture failed "
            "(they run eagerly)", registry=r)
        self.m_step_replays = prometheus_client.Counter(
            "lamina_model_step_graph_replays", "decode steps replayed whole as CUDA graphs (colocated)", registry=r)
        self.m_warm_up = prometheus_client.Gauge(
            "lamina_model_warm_up_seconds", "the warm-up step's seconds, before the worker served (0: none, "
            "warm_up false)", registry=r)
        self.m_graph_captures = prometheus_client.Counter(
            "lamina_model_graph_captures", "CUDA graphs captured: decode slices and (colocated) whole steps, at "
            "start (warm_up_graph_keys) or by the first step that needs one", registry=r)
        self.m_step_failures = prometheus_client.Counter(
            "lamina_model_step_graph_capture_failures", "batch and context buckets whose whole-step CUDA graph "
            "capture failed (their steps run the same launches eagerly)", registry=r)
        self.pool: AttentionPool | None = None
        self.executors: SliceExecutors | None = None  # rotational only
        self.slice_server = SliceServer(self.slices.split.slices, self._serve_slice)
        self.attention = _colocated_attention(config, index, self.runtime.stopping) if config.colocated else None
        core = None if self.attention is None else self.attention.core
        if core is not None and core.paged and core.device == self.slices.device and mw.cuda_graphs \
                and mw.step_graphs:
            self.slices.step_graphs = SlabStepGraphs(self.slices.split, core.slabs.k_pools, core.slabs.v_pools)
        self._runner: DecodeRunner | None = None
        # The totals _count_work reports: seconds computing, sending, awaiting replies and
        # waiting for the GPU (a process-wide clock, counted from its value now), slices run
        # on peers, graph replays and failed captures, and seconds attending here (passed to
        # the colocated attention service, not counted here).
        self._totals = CounterTotals(
            {"compute": self.m_compute, "send": self.m_send, "remote": self.m_remote, "reply_wait": self.m_reply_wait,
             "device_wait": self.m_device_wait, "slice_replays": self.m_graph_replays,
             "slice_failures": self.m_graph_failures, "step_replays": self.m_step_replays,
             "step_failures": self.m_step_failures, "captures": self.m_graph_captures, "local": None},
            start={"device_wait": DEVICE_WAITS.seconds})

    def _serve_slice(self, j, inputs, attn, context) -> SliceOutput:
        out = self.slices.run_slice(j, inputs, attn, context)
        self.m_served.inc()
        self._count_work()
        return out

    def _on_step(self, num_seqs: int, wall_s: float) -> None:
        self.m_steps.inc()
        self.m_batch.observe(num_seqs)
        self.m_step_seconds.observe(wall_s)
        self._count_work()

    def _count_work(self) -> None:
        """Add what the slices, the pool and the executors did since the last count to the counters."""
        pool, graphs, steps = self.pool, self.slices.graphs, self.slices.step_graphs
        grew = self._totals.report({
            "compute": self.slices.compute_s, "send": pool.send_s if pool else 0.0,
            "remote": self.executors.remote_slices if self.executors else 0,
            "reply_wait": pool.reply_wait_s if pool else 0.0, "device_wait": DEVICE_WAITS.seconds,
            "slice_replays": graphs.replays if graphs else 0, "slice_failures": graphs.failures if graphs else 0,
            "step_replays": steps.replays if steps else 0, "step_failures": steps.failures if steps else 0,
            "captures": self._graph_captures(),
            "local": pool.local_s if pool else 0.0})
        if self.attention is not None:
            self.attention.count_local(grew["local"])

    async def decode(self, updates):
        """One Decode stream: apply the scheduler's updates, yield step results.

        A new stream replaces the one before (a restarted scheduler): the old
        stream's sequences are dropped with it."""
        if self._runner is not None:
            log.warning("a new decode stream replaces the running one")
            await self._runner.close()
        first = await anext(aiter(updates), None)
        if first is None:
            return
        if self.executors is not None:
            await self.executors.refresh()  # peers started after this worker are found now

        async def forward(mb, step, batch, rows):
            return await self.slices.forward(mb, step, batch, rows, self.pool, self.executors)

        runner = DecodeRunner(forward, self.config.decode_micro_batches, first.stop, on_step=self._on_step,
                              min_micro_batch=self.config.pipeline.min_micro_batch, grammars=self.slices.grammars,
                              hand_off_s=COLOCATED_HAND_OFF_S if self.attention is not None else 0.0)
        self._runner = runner
        runner.join(list(first.joins))
        runner.leave(list(first.leaves))
        runner.start()

        async def read_updates() -> None:
            async for u in updates:
                runner.join(list(u.joins))
                runner.leave(list(u.leaves))

        # The scheduler closing its side (or the stream breaking) ends the reader, which
        # queues `end` behind the results already made. Results are awaited straight from
        # the queue: a step's result reaches gRPC in one loop turn (see DecodeRunner's hand-off).
        end = lamina_pb2.DecodeResult()
        reader = asyncio.create_task(read_updates(), name="decode-updates")
        reader.add_done_callback(lambda _: runner.results.put_nowait(end))
        try:
            while (result := await runner.results.get()) is not end:
                runner.taken()
                yield result
            reader.result()  # what ended the stream, raised here
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            await runner.close()
            if self._runner is runner:
                self._runner = None

    async def _peer_slice_services(self) -> dict[int, str]:
        """The other model workers' slice services, as registered."""
        found = {}
        for info in await self.runtime.store.list_services("model"):
            index, address = info.meta.get("index"), info.meta.get("slices")
            if isinstance(index, int) and index != self.index and isinstance(address, str):
                found[index] = address
        return found

    async def run(self) -> None:
        if self.attention is None:
            await self._serve()
            return
        # The colocated attention worker lives as long as this service: either ending
        # (a signal sets their shared stop) ends the other.
        attending = asyncio.create_task(self.attention.run(), name="colocated-attention")
        attending.add_done_callback(lambda _: self.runtime.stopping.set())
        try:
            await self._serve()
        finally:
            self.runtime.stopping.set()
            await attending

    def warm_up(self) -> float:
        """One decode-shaped step, a made-up token, through the slices on this thread,
        where the steps compute (services/warm_up.py), before the worker registers; on a
        GPU its CUDA graphs captured then (`capture_graphs`). Returns its seconds."""
        inputs = warm_up_inputs(self.slices.cfg.vocab_size, 1, self.slices.device)
        started = time.perf_counter()
        with torch.inference_mode():
            self.slices.split.run(inputs, attend_own, reuse_outputs=True)
        captured = self.capture_graphs()
        seconds = finished(self.slices.device, started)
        self._count_work()  # the graphs captured
        self.m_warm_up.set(seconds)
        log.info("warm-up step: %.0f ms%s", 1000 * seconds, f" ({captured} CUDA graphs captured)" if captured else "")
        return seconds

    def capture_graphs(self) -> int:
        """The CUDA graphs this worker's decode steps replay, captured before it serves for
        every bucket of services/warm_up.py's `graph_plan`: colocated, the whole steps
        (or, without them, the slices' and the attention core's graphs); else each
        micro-batch's slices, by a made-up step of each batch bucket on its stream (the
        slices' graphs attend over nothing; rotational steps replay none). Where the GPU
        runs out of memory, the worker serves with what was captured (logged): the rest
        are captured at the first step that needs them, as without the plan. Returns the
        graphs made; their replays here are not counted."""
        plan = graph_plan(self.config, self.slices.cfg.max_position_embeddings)
        if plan is None:
            return 0
        slices, graphs, steps = self.slices, self.slices.graphs, self.slices.step_graphs
        made = 0 if self.attention is None or steps is not None else self.attention.capture_graphs()
        before, replays = self._graph_captures(), graphs.replays if graphs is not None else 0
        try:
            if steps is not None:
                with torch.inference_mode():  # as the steps run (a failed capture's body runs eagerly)
                    steps.prepare(plan.buckets, plan.contexts)
            elif graphs is not None and not self.config.rotational:
                for m in range(self.config.decode_micro_batches):
                    call_slice = graphs.caller(m)
                    for rows in plan.buckets:
                        with slices.staging.stream(m), torch.inference_mode():
                            inputs = decode_inputs(slices.cfg.vocab_size, rows, slices.device)
                            slices.split.run(inputs, attend_own, reuse_outputs=True, call_slice=call_slice)
        except torch.OutOfMemoryError as exc:
            log.warning("CUDA graphs captured at start: stopped after %d, out of memory (%s); the others are captured "
                        "at the first step that needs them", self._graph_captures() - before, exc)
        finally:
            if graphs is not None:
                graphs.replays = replays  # lamina_model_graph_replays counts decode steps' replays
        return made + self._graph_captures() - before

    def _graph_captures(self) -> int:
        """CUDA graphs captured so far: decode slices' and whole steps'."""
        graphs, steps = self.slices.graphs, self.slices.step_graphs
        return (graphs.captures if graphs is not None else 0) + (steps.captures if steps is not None else 0)

    async def _serve(self) -> None:
        if self.config.warm_up:
            self.warm_up()
        local = {} if self.attention is None else {self.index: self.attention.core}
        self.pool = await AttentionPool.from_registry(self.runtime.store, self.config, self.slices.cfg, local)
        meta: dict = {"index": self.index, "device": str(self.slices.device)}
        listener = None
        try:
            if self.config.rotational:
                tcfg = self.config.transport_config()
                listener = await transports.listen(self.config.data_address(self.runtime.service_id),
                                                   self.slice_server.serve_connection, tcfg)
                meta["slices"] = with_host(listener.address, self.config.advertised_host)
                self.executors = SliceExecutors(self.slices.split.slices, self.slices.run_slice,
                                                self._peer_slice_services, tcfg, self.config.deadlines.reply_s,
                                                self.config.model_worker.workers)
            await self.runtime.serve(
                lambda s: lamina_pb2_grpc.add_ModelWorkerServicer_to_server(_ModelServicer(self), s), meta=meta)
        finally:
            if self.executors is not None:
                await self.executors.close()
            if listener is not None:
                await listener.close()
            await self.pool.close()


def _colocated_attention(config: StackConfig, index: int, stopping: asyncio.Event) -> AttentionService:
    """Attention worker `index`, to run in this process beside its model worker. Fixed
    ports (one service per host) are taken one above the model worker's: two servers
    cannot share one."""
    p = config.ports
    ports = PortsSection(grpc=p.grpc + 1 if p.grpc else 0, metrics=p.metrics + 1 if p.metrics else 0)
    service = AttentionService(dataclasses.replace(config, ports=ports), index)
    service.runtime.stopping = stopping  # one process, one stop: a signal ends both
    return service


def serve(config: StackConfig, threads: int | None = None, index: int = 0) -> None:
    set_compute_threads(threads or config.model_worker.threads)
    install_uvloop()
    asyncio.run(ModelService(config, index).run())
