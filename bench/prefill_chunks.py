"""A short prompt's first token behind a long prompt's prefill: whole against chunked.

A prefill worker computed each prompt in one forward: a short prompt queued behind a long
one waited for all of the long one's forward. It now computes at most
`prefill.chunk_tokens` of a prompt a forward (services/prefill/chunking.py), and the
prompts queued meanwhile join its next forward. This compares the two, alternately, on
the real model (SmolLM2-135M-Instruct, its weights as the GGUF file holds them, on the
CPU): a prefill worker's own code (PrefillService's batch loop, forward thread and
sends) and one attention worker's data-plane handler, over TCP in this process, the
prefix cache off (each try's prompts are new anyway):

- `whole`: `prefill.chunk_tokens` past the long prompt's length;
- `chunked`: `prefill.chunk_tokens` = --chunk.

Each try sends the long prompt, then the short one as the long one's first forward begins,
and times, from each one's send, its first token (the prefill call's answer, with its KV
stored at the attention worker). The short prompt alone is timed first on each worker.

Prints the machine, the workload, each try, the medians and the ratios chunked / whole;
the last line is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch
from engine_throughput import cpu_model  # bench/: the CPU's model name, as the other benchmarks print it

from lamina import transports
from lamina.model.threads import set_compute_threads
from lamina.services.attention.attention_service import AttentionService
from lamina.services.attention_pool import AttentionPool
from lamina.services.config import AttentionSection, PrefillSection, StackConfig
from lamina.services.prefill.prefill_service import PrefillService
from lamina.services.protos import lamina_pb2

VARIANTS = ("whole", "chunked")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--long", type=int, default=2048, help="the long prompt's tokens")
    p.add_argument("--short", type=int, default=16, help="the short prompt's tokens")
    p.add_argument("--chunk", type=int, default=512, help="prefill.chunk_tokens of the chunked worker")
    p.add_argument("--tries", type=int, default=3, help="tries of each variant, alternated")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the forwards' compute threads")
    return p.parse_args(argv)


class _Worker:
    """A prefill worker's service and an attention worker's handler, in this process."""

    def __init__(self, chunk: int) -> None:
        self.config = StackConfig(redis_url="redis://127.0.0.1:1", prefill=PrefillSection(
            chunk_tokens=chunk, max_batch_tokens=2048, cache_device_bytes=0),
            attention=AttentionSection(workers=1, kv_capacity_bytes=256 << 20))
        self.svc = PrefillService(self.config)
        self.attention = AttentionService(self.config)
        self.began = asyncio.Event()
        forward = self.svc._forward

        async def signalled(kv, prompts):
            self.began.set()
            return await forward(kv, prompts)

        self.svc._forward = signalled  # type: ignore[method-assign]

    async def start(self) -> None:
        transport = self.config.transport_config()
        self.listener = await transports.listen("tcp://127.0.0.1:0", self.attention._serve_connection, transport)
        self.svc.pool = await AttentionPool.connect([self.listener.address], "request", self.svc.cfg, transport)
        self.batches = asyncio.create_task(self.svc._batch_loop())

    async def stop(self) -> None:
        self.batches.cancel()
        await asyncio.gather(self.batches, return_exceptions=True)
        if self.svc.pool is not None:
            await self.svc.pool.close()
        await self.listener.close()
        self.svc.forward_thread.close(wait=True)

    async def first_token_s(self, seq_id: str, tokens: list[int]) -> float:
        """Seconds from the prompt's send to its first token; its KV freed after."""
        start = time.perf_counter()
        await self.svc.prefill(lamina_pb2.PrefillRequest(
            seq_id=seq_id, token_ids=tokens, params=lamina_pb2.SamplingParams(max_tokens=1),
            placement=lamina_pb2.Placement(workers=[0])))
        seconds = time.perf_counter() - start
        self.attention.core.free([seq_id])
        return seconds

    async def long_then_short(self, n: int, long: list[int], short: list[int]) -> dict[str, float]:
        self.began.clear()
        behind = asyncio.create_task(self.first_token_s(f"long-{n}", long))
        await self.began.wait()
        short_s = await self.first_token_s(f"short-{n}", short)
        return {"short_s": short_s, "long_s": await behind}


def _prompt(n: int, length: int, vocab: int) -> list[int]:
    return [100 + (i * 7919 + n * 104729) % (vocab - 200) for i in range(length)]


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    workers = {"whole": _Worker(args.long + args.short + 1), "chunked": _Worker(args.chunk)}
    vocab = workers["whole"].svc.cfg.vocab_size
    tries: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    alone: dict[str, float] = {}
    try:
        for w in workers.values():
            await w.start()
        for v, w in workers.items():
            await w.first_token_s("warm", _prompt(0, 8, vocab))
            alone[v] = await w.first_token_s("alone", _prompt(1, args.short, vocab))
        for t in range(args.tries):
            for v in VARIANTS if t % 2 == 0 else VARIANTS[::-1]:
                n = 2 + 2 * t + VARIANTS.index(v)  # new prompts each try
                row = await workers[v].long_then_short(n, _prompt(n, args.long, vocab), _prompt(-n, args.short, vocab))
                tries[v].append(row)
                print(f"  {v:<8} short's first token {row['short_s'] * 1000:9.1f} ms   "
                      f"long's {row['long_s'] * 1000:9.1f} ms", flush=True)
    finally:
        for w in workers.values():
            if hasattr(w, "batches"):
                await w.stop()
    return {"tries": tries, "alone_s": alone}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_compute_threads(args.threads)
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"torch {torch.__version__}")
    print(f"workload: SmolLM2-135M-Instruct (as_file weights), a {args.long}-token prompt, then a "
          f"{args.short}-token prompt sent as its first forward begins; {args.threads} compute threads, "
          f"{args.tries} tries per variant, alternated; compared: whole, chunked ({args.chunk} tokens)")
    result = asyncio.run(_run(args))
    tries = result["tries"]
    med = {v: {k: statistics.median(r[k] for r in tries[v]) for k in ("short_s", "long_s")} for v in VARIANTS}
    ratios = {k: med["chunked"][k] / med["whole"][k] for k in ("short_s", "long_s")}
    print(f"\n{'':<8}  {'short alone':>12}  {'short behind long':>18}  {'long':>10}")
    for v in VARIANTS:
        print(f"{v:<8}  {result['alone_s'][v] * 1000:9.1f} ms  {med[v]['short_s'] * 1000:15.1f} ms  "
              f"{med[v]['long_s'] * 1000:7.1f} ms")
    print(f"chunked / whole: short behind long {ratios['short_s']:.3f}, long {ratios['long_s']:.3f}")
    print(json.dumps({"machine": cpu_model(), "cores": os.cpu_count(), "threads": args.threads, "long": args.long,
                      "short": args.short, "chunk": args.chunk, "tries": tries, "alone_s": result["alone_s"],
                      "median": med, "chunked_over_whole": ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
