"""The model-slice service: holds the weights and the slices, runs decode steps.

For each step it runs slice 0, then for every layer sends Q, K, V to the
attention workers holding the batch's KV and runs the next slice on their
output; after the last slice it samples. Stateless between steps: the KV lives
on the attention workers and the sequences' state at the scheduler, so a lost
model worker is replaced without losing requests.
"""

from __future__ import annotations

import asyncio
import logging
import time

import prometheus_client
import torch

import transports
from lamina.engine.sampling import SamplingParams, sample
from lamina.engine.step import StepBatch
from model.llama import split_llama
from model.loader import load_model
from services.attention_pool import AttentionPool, SeqRows
from services.config import StackConfig
from services.protos import lamina_pb2, lamina_pb2_grpc
from services.runtime import ServiceRuntime, abort_for_remote_error
from services.wire import RemoteError

log = logging.getLogger(__name__)


def params_from_proto(p: lamina_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(max_tokens=max(1, p.max_tokens), temperature=p.temperature, top_p=p.top_p or 1.0,
                          top_k=p.top_k, seed=p.seed, stop_token_ids=tuple(p.stop_token_ids),
                          ignore_eos=p.ignore_eos)


class ModelSlices:
    """The split model and how one batch runs through it with remote attention."""

    def __init__(self, model_path: str | None) -> None:
        self.loaded = load_model(model_path)
        self.cfg = self.loaded.config
        self.split = split_llama(self.loaded.model)

    async def forward(self, batch: StepBatch, seqs: list[SeqRows], pool: AttentionPool) -> torch.Tensor:
        """Logits [B, V] of the batch; attention runs on the pool's workers."""
        inputs = batch.model_inputs()
        with torch.inference_mode():
            out = self.split.slices[0](inputs)
            n = self.split.num_attention
            for i in range(n):
                q, k, v = out.qkv
                attn = await pool.attend(i, seqs, q, k, v, commit=i == n - 1)
                out = self.split.slices[i + 1](inputs, attn, out.context)
        return out.output


class _ModelServicer(lamina_pb2_grpc.ModelWorkerServicer):
    def __init__(self, service: ModelService) -> None:
        self.service = service

    async def Step(self, request, context):  # noqa: N802
        try:
            tokens = await self.service.step(request)
        except (RemoteError, transports.TransportError) as exc:
            await abort_for_remote_error(context, exc)
        return lamina_pb2.StepResult(token_ids=tokens)


class ModelService:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.slices = ModelSlices(config.model)
        self.runtime = ServiceRuntime("model", "model-0", config)
        r = self.runtime.registry
        self.m_steps = prometheus_client.Counter("lamina_model_steps", "decode steps run", registry=r)
        self.m_step_seconds = prometheus_client.Histogram("lamina_model_step_seconds", "decode step time", registry=r)
        self.m_batch = prometheus_client.Histogram("lamina_model_batch_size", "sequences per step",
                                                   buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.pool: AttentionPool | None = None
        self._lock = asyncio.Lock()

    async def step(self, request: lamina_pb2.StepRequest) -> list[int]:
        seqs = list(request.seqs)
        if not seqs:
            return []
        async with self._lock:  # the pool's connections carry one step at a time
            start = time.perf_counter()
            batch = StepBatch.build([s.seq_id for s in seqs], [[s.token_id] for s in seqs],
                                    [s.position for s in seqs])
            rows = [SeqRows(s.seq_id, 1, list(s.placement.workers)) for s in seqs]
            logits = await self.slices.forward(batch, rows, self.pool)
            params = [params_from_proto(s.params) for s in seqs]
            tokens = sample(logits, params, [s.params.seed for s in seqs], [s.output_index for s in seqs])
            self.m_steps.inc()
            self.m_batch.observe(len(seqs))
            self.m_step_seconds.observe(time.perf_counter() - start)
            return tokens

    async def run(self) -> None:
        self.pool = await AttentionPool.from_registry(self.runtime.store, self.config, self.slices.cfg)
        try:
            await self.runtime.serve(lambda s: lamina_pb2_grpc.add_ModelWorkerServicer_to_server(_ModelServicer(self), s))
        finally:
            await self.pool.close()


def serve(config: StackConfig, threads: int | None = None) -> None:
    torch.set_num_threads(threads or config.model_worker.threads)
    transports.install_uvloop()
    asyncio.run(ModelService(config).run())
