"""The model-slice service: holds the weights and the slices, runs decode steps.

The scheduler opens one Decode stream to each model worker and sends batch changes
on it; the worker's DecodeRunner steps its sequences in `pipeline.micro_batches`
staggered micro-batches and streams every step's tokens back. A step runs slice 0,
then for every layer sends Q, K, V to the attention workers holding the micro-batch's
KV and runs the next slice on their output; after the last slice it samples.

The worker keeps each decoding sequence's latest token and position (sent whole
when the sequence joins); its KV lives on the attention workers. When its stream
ends, the worker drops them all.
"""

from __future__ import annotations

import asyncio
import logging
import time

import prometheus_client
import torch

import transports
from lamina.engine.step import StepBatch
from model.llama import split_llama
from model.loader import load_model
from services.attention_pool import AttentionPool, SeqRows
from services.config import StackConfig
from services.decode_runner import DecodeRunner
from services.protos import lamina_pb2, lamina_pb2_grpc
from services.runtime import ServiceRuntime
from services.wire import decode_tag

log = logging.getLogger(__name__)


class ModelSlices:
    """The split model and how one batch runs through it with remote attention."""

    def __init__(self, model_path: str | None, weights: str = "float32") -> None:
        self.loaded = load_model(model_path, weights=weights)
        self.cfg = self.loaded.config
        self.split = split_llama(self.loaded.model)
        self.compute_s = 0.0  # CPU time in the slices, every micro-batch together

    async def forward(self, micro_batch: int, step: int, batch: StepBatch, seqs: list[SeqRows],
                      pool: AttentionPool) -> torch.Tensor:
        """Logits [B, V] of the batch; attention runs on the pool's workers.

        Micro-batches interleave at the awaits, so grad mode is set per slice call,
        never held across an await."""
        inputs = batch.model_inputs()
        route = pool.route(seqs)
        slices = self.split.slices
        # CPU time of this thread, not wall time: on a shared host the figure stays the
        # work done, whoever else takes the core meanwhile.
        t0 = time.thread_time()
        with torch.inference_mode():
            out = slices[0](inputs)
        self.compute_s += time.thread_time() - t0
        for i in range(self.split.num_attention):
            q, k, v = out.qkv
            attn = await pool.attend(decode_tag(micro_batch, step, i), i, route, q, k, v)
            t0 = time.thread_time()
            with torch.inference_mode():
                out = slices[i + 1](inputs, attn, out.context)
            self.compute_s += time.thread_time() - t0
        return out.output


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
        self.slices = ModelSlices(config.model, config.weights)
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
        self.pool: AttentionPool | None = None
        self._runner: DecodeRunner | None = None
        self._reported = (0.0, 0.0)  # compute and send seconds already counted

    def _on_step(self, num_seqs: int, wall_s: float) -> None:
        self.m_steps.inc()
        self.m_batch.observe(num_seqs)
        self.m_step_seconds.observe(wall_s)
        self.m_compute.inc(self.slices.compute_s - self._reported[0])
        self.m_send.inc(self.pool.send_s - self._reported[1])
        self._reported = (self.slices.compute_s, self.pool.send_s)

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
        pipe = self.config.pipeline

        async def forward(mb, step, batch, rows):
            return await self.slices.forward(mb, step, batch, rows, self.pool)

        runner = DecodeRunner(forward, pipe.micro_batches, first.stop, on_step=self._on_step,
                              min_micro_batch=pipe.min_micro_batch)
        self._runner = runner
        runner.join(list(first.joins))
        runner.leave(list(first.leaves))
        runner.start()

        async def read_updates() -> None:
            async for u in updates:
                runner.join(list(u.joins))
                runner.leave(list(u.leaves))

        reader = asyncio.create_task(read_updates(), name="decode-updates")
        next_result = asyncio.ensure_future(runner.results.get())
        try:
            while True:
                done, _ = await asyncio.wait({reader, next_result}, return_when=asyncio.FIRST_COMPLETED)
                if next_result in done:
                    yield next_result.result()
                    next_result = asyncio.ensure_future(runner.results.get())
                elif reader in done:
                    reader.result()  # the scheduler closed its side (or the stream broke): end here
                    return
        finally:
            for t in (reader, next_result):
                t.cancel()
            await asyncio.gather(reader, next_result, return_exceptions=True)
            await runner.close()
            if self._runner is runner:
                self._runner = None

    async def run(self) -> None:
        self.pool = await AttentionPool.from_registry(self.runtime.store, self.config, self.slices.cfg)
        try:
            await self.runtime.serve(lambda s: lamina_pb2_grpc.add_ModelWorkerServicer_to_server(_ModelServicer(self), s),
                                     meta={"index": self.index})
        finally:
            await self.pool.close()


def serve(config: StackConfig, threads: int | None = None, index: int = 0) -> None:
    torch.set_num_threads(threads or config.model_worker.threads)
    transports.install_uvloop()
    asyncio.run(ModelService(config, index).run())
