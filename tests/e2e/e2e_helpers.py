"""Starting the real stack for end-to-end tests, and the prompts they use."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import urllib.request

from lamina.ports import free_port
from lamina.services.config import (
    AttentionSection,
    DeadlinesSection,
    GatewaySection,
    ModelWorkerSection,
    PipelineSection,
    PrefillSection,
    StackConfig,
)
from lamina.services.launch.launcher import Stack

CHAT_PROMPTS = ["What is the capital of France?", "Name two colours of the rainbow."]
COMPLETION_PROMPTS = ["The three primary colours are", "def add(a, b):\n    return"]
MAX_TOKENS = 16


def start_stack(transport: str = "tcp", partition: str = "request", workers: int = 2, micro_batches: int = 2,
                q_early: bool = False, model_workers: int = 1, weights: str = StackConfig.weights,
                deadlines: DeadlinesSection | None = None, supervise: bool = False,
                prefill: PrefillSection | None = None, pipeline_mode: str = "fixed",
                prefill_workers: int | None = None, attention_max_workers: int = 0,
                layout: str = "disaggregated", prefill_threads: int = 0, fork_services: bool = True,
                **kw) -> Stack:
    prefill = prefill or PrefillSection()
    if prefill_workers is not None:
        prefill = dataclasses.replace(prefill, workers=prefill_workers)
    if prefill_threads:
        prefill = dataclasses.replace(prefill, threads=prefill_threads)
    config = StackConfig(layout=layout, transport=transport, partition=partition, weights=weights,
                         fork_services=fork_services,
                         deadlines=deadlines or DeadlinesSection(), prefill=prefill,
                         gateway=GatewaySection(port=free_port(), **kw),
                         attention=AttentionSection(workers=workers, max_workers=attention_max_workers,
                                                    kv_capacity_bytes=256 << 20),
                         model_worker=ModelWorkerSection(workers=model_workers),
                         # min_micro_batch 1: the few requests of a test still fill every micro-batch.
                         pipeline=PipelineSection(micro_batches=micro_batches, q_early=q_early, min_micro_batch=1,
                                                  mode=pipeline_mode))
    stack = Stack(config, supervise=supervise)
    stack.start(timeout_s=240)
    return stack


def api_key(stack: Stack) -> str:
    """What a client of `stack` sends as its API key (the gateway checks it only when it has one)."""
    return stack.config.gateway.api_key or "unused"


async def attention_stats(stack: Stack) -> list:
    """Every attention worker's AttentionStats, in worker order, over gRPC."""
    from lamina.kvstore.metadata import MetadataConfig, MetadataStore
    from lamina.services.channels import open_channel
    from lamina.services.protos import lamina_pb2, lamina_pb2_grpc

    store = MetadataStore(MetadataConfig(url=stack.config.redis_url, namespace=stack.config.namespace))
    try:
        services = sorted(await store.list_services("attention"), key=lambda s: s.service_id)
    finally:
        await store.close()
    stats = []
    for s in services:
        async with open_channel(s.meta["grpc"], stack.config.cluster_token) as ch:
            stats.append(await lamina_pb2_grpc.AttentionControlStub(ch).Stats(lamina_pb2.Empty()))
    return stats


def service_metric(stack: Stack, kind: str, service_id: str, name: str) -> float:
    """One sample of a service's Prometheus metrics, read over HTTP."""
    for line in _metric_lines(stack, kind, service_id):
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"the metrics of {service_id} lack {name}")


def metric_total(stack: Stack, kind: str, service_id: str, name: str, host: str | None = None) -> float:
    """The sum of every sample of metric `name` (each label's) a service exports; 0 with none.
    `host`: the service's address where it is not the stack's `host` (a host of its own)."""
    return sum(float(line.split()[-1]) for line in _metric_lines(stack, kind, service_id, host)
               if line.startswith((name + " ", name + "{")))


def _metric_lines(stack: Stack, kind: str, service_id: str, host: str | None = None) -> list[str]:
    from lamina.kvstore.metadata import MetadataConfig, MetadataStore

    async def metrics_port() -> int:
        store = MetadataStore(MetadataConfig(url=stack.config.redis_url, namespace=stack.config.namespace))
        try:
            info = await store.get_service(kind, service_id)
        finally:
            await store.close()
        assert info is not None, f"{kind} {service_id} is not registered"
        return int(info.meta["metrics_port"])

    port = asyncio.run(metrics_port())
    with urllib.request.urlopen(f"http://{host or stack.config.host}:{port}/metrics", timeout=10) as r:
        return r.read().decode().splitlines()


def complete(stack: Stack, prompt: list[int], max_tokens: int, **extra) -> dict:
    """One greedy /v1/completions call with a prompt of token ids (and `extra` fields in its
    body); the response's JSON."""
    with urllib.request.urlopen(stack.base_url + "/v1/models", timeout=30) as r:
        model = json.loads(r.read())["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       **extra}).encode()
    req = urllib.request.Request(stack.base_url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


async def until(check, timeout_s: float = 15.0, every_s: float = 0.2):
    """Polls `check()` (an async function) until it returns something true; returns it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not (result := await check()):
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(every_s)  # polls another process's state: nothing here to wait on
    return result
