"""Serving benchmark: the running stack over HTTP against the local engine in one process.

Workload: requests from the Azure conversation trace (../shared/traces/azure_conv_2023.csv),
with their arrival times and lengths. Scaled to 2 CPU cores: the first --num-requests
requests after a fixed offset, token lengths divided by --scale (kept >= 1, prompts capped
at --max-prompt, outputs at --max-output), inter-arrival gaps divided by --time-scale.
Prompts are synthetic text of the right token length; output length is forced
(ignore_eos) so both systems generate the same number of tokens. --decode-heavy takes 32
requests at once with outputs lengthened to 32..96 tokens, so decode dominates.

It starts the stack itself (`lamina up` in-process: embedded Redis, every service in its
own process) unless --url points at one already running, replays the trace against the
OpenAI API with streaming, then runs the same requests at the same arrival times through
the local engine in one process (continuous batching). With a large --time-scale every
request arrives at once and the figures are saturated throughput. Prints throughput, time to first
token and time between tokens (mean, p50, p99), the stack's mean decode batch size, the
ratio stack / local engine, and as its last line one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import json
import os
import platform
import statistics
import time
from datetime import datetime
from pathlib import Path

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"


def load_trace(n: int, offset: int, scale: int, time_scale: float, max_prompt: int, max_output: int,
               min_output: int = 1):
    rows = []
    with open(TRACES / "azure_conv_2023.csv") as f:
        reader = csv.DictReader(f)
        for i, row in enumerate(reader):
            if i < offset:
                continue
            if len(rows) >= n:
                break
            rows.append(row)
    t0 = None
    out = []
    for row in rows:
        whole, _, frac = row["TIMESTAMP"].partition(".")
        ts = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").timestamp() + float("0." + (frac or "0"))
        t0 = ts if t0 is None else t0
        prompt = min(max_prompt, max(1, int(row["ContextTokens"]) // scale))
        output = min(max_output, max(min_output, int(row["GeneratedTokens"]) // scale))
        out.append(((ts - t0) / time_scale, prompt, output))
    return out


def make_prompt_ids(tokenizer, n: int, salt: int) -> list[int]:
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards",
             "quietly", "judge", "boxing"]
    ids: list[int] = []
    i = salt
    while len(ids) < n:
        ids.extend(tokenizer.encode(" " + words[i % len(words)]))
        i += 7
    return ids[:n]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def summary(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values) if values else float("nan"), "p50": pct(values, 0.5),
            "p99": pct(values, 0.99)}


async def replay(url: str, model: str, workload, prompts, concurrency: int | None = None) -> dict:
    """Stream every request at its arrival time; with `concurrency`, at most that many at
    once (a request that arrives while they are all busy waits, and its timings start
    when it is sent). TTFT: from just before the request is sent to its first chunk with
    text; TBT: between successive chunks with text, one sample per gap."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    ttft: list[float] = []
    tbt: list[float] = []
    tokens = 0
    slots = asyncio.Semaphore(concurrency) if concurrency else contextlib.nullcontext()
    start = time.perf_counter()

    async def one(arrival, ids, out_len):
        nonlocal tokens
        await asyncio.sleep(max(0.0, arrival - (time.perf_counter() - start)))
        async with slots:
            sent = time.perf_counter()
            last = None
            stream = await client.completions.create(model=model, prompt=ids, max_tokens=out_len, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True},
                                                     stream_options={"include_usage": True})
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.usage is not None:
                    tokens += chunk.usage.completion_tokens
                if not chunk.choices:
                    continue
                if last is None:
                    ttft.append(now - sent)
                else:
                    tbt.append(now - last)
                last = now

    await asyncio.gather(*(one(a, ids, o) for (a, _, o), ids in zip(workload, prompts)))
    elapsed = time.perf_counter() - start
    return {"tok_s": tokens / elapsed, "tokens": tokens, "seconds": elapsed, "ttft_s": summary(ttft),
            "tbt_s": summary(tbt)}


def run_local(workload, prompts, threads: int) -> dict:
    """The same requests at the same arrival times through the local engine in this process."""
    from lamina.engine import Engine, SamplingParams
    from lamina.model.loader import load_model
    from lamina.model.threads import set_compute_threads

    set_compute_threads(threads)  # the products on `threads` threads, torch's ops on one
    engine = Engine(load_model())
    pending = list(zip(workload, prompts))
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    tbt: list[float] = []
    tokens = 0
    start = time.perf_counter()
    while pending or engine.has_work():
        now = time.perf_counter() - start
        while pending and pending[0][0][0] <= now:
            (t, _, out_len), ids = pending.pop(0)
            sid = engine.add_request(ids, SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True))
            arrival[sid] = t
        if not engine.has_work():
            time.sleep(max(0.0, pending[0][0][0] - now))  # idle until the next arrival in the trace
            continue
        for out in engine.step():
            t = time.perf_counter() - start
            tokens += len(out.new_token_ids)
            if out.seq_id in first:
                tbt.append(t - last[out.seq_id])
            else:
                first[out.seq_id] = t - arrival[out.seq_id]
            last[out.seq_id] = t
    elapsed = time.perf_counter() - start
    return {"tok_s": tokens / elapsed, "tokens": tokens, "seconds": elapsed,
            "mean_batch_size": engine.sum_batch_size / max(1, engine.num_steps),
            "ttft_s": summary(list(first.values())), "tbt_s": summary(tbt)}


async def scheduler_stats(redis_url: str, namespace: str, token: str | None = None) -> dict:
    from lamina.kvstore.metadata import MetadataConfig, MetadataStore
    from lamina.services.channels import open_channel
    from lamina.services.protos import lamina_pb2, lamina_pb2_grpc

    store = MetadataStore(MetadataConfig(url=redis_url, namespace=namespace))
    try:
        (sched,) = await store.list_services("scheduler")
    finally:
        await store.close()
    async with open_channel(sched.endpoint, token) as ch:
        s = await lamina_pb2_grpc.SchedulerStub(ch).Stats(lamina_pb2.Empty())
    return {"num_steps": s.num_steps, "mean_batch_size": s.mean_batch_size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--scale", type=int, default=16, help="divide token lengths by this")
    ap.add_argument("--time-scale", type=float, default=1.0, help="divide inter-arrival gaps by this")
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=32)
    ap.add_argument("--min-output", type=int, default=1, help="outputs shorter than this are lengthened")
    ap.add_argument("--decode-heavy", action="store_true",
                    help="32 requests at once, outputs of 32-96 tokens (mean >= 32): decode dominates")
    ap.add_argument("--micro-batches", type=int, default=None, help="the stack's pipeline.micro_batches")
    ap.add_argument("--url", default=None, help="a running stack (default: start one)")
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--local-threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    if args.decode_heavy:
        args.num_requests, args.time_scale, args.min_output, args.max_output = 32, 1000.0, 32, 96

    from lamina.model.checkpoints import load_tokenizer

    tokenizer, _ = load_tokenizer()
    workload = load_trace(args.num_requests, args.offset, args.scale, args.time_scale, args.max_prompt,
                          args.max_output, args.min_output)
    prompts = [make_prompt_ids(tokenizer, p, i) for i, (_, p, _) in enumerate(workload)]
    print(f"workload: {len(workload)} requests from azure_conv_2023.csv (offset {args.offset}), lengths / "
          f"{args.scale} (prompt <= {args.max_prompt}, output {args.min_output}..{args.max_output}, forced), "
          f"arrivals / "
          f"{args.time_scale}; mean prompt {statistics.fmean(p for _, p, _ in workload):.1f} tokens, "
          f"mean output {statistics.fmean(o for _, _, o in workload):.1f} tokens, span {workload[-1][0]:.1f} s")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{platform.python_implementation()} {platform.python_version()}")

    stack = None
    url = args.url
    stats: dict = {}
    if url is None:
        from lamina.services.config import PipelineSection, StackConfig
        from lamina.services.launch.launcher import Stack

        config = StackConfig(transport=args.transport)
        if args.micro_batches:
            config = StackConfig(transport=args.transport, pipeline=PipelineSection(micro_batches=args.micro_batches))
        stack = Stack(config)
        print(f"starting the stack (2 attention workers, request-level partitioning, "
              f"{config.pipeline.micro_batches} micro-batches)...", flush=True)
        stack.start()
        url = stack.base_url
    try:
        import openai

        model = openai.OpenAI(base_url=url + "/v1", api_key="unused").models.list().data[0].id
        served = asyncio.run(replay(url, model, workload, prompts))
        if stack is not None:
            stats = asyncio.run(scheduler_stats(stack.config.redis_url, stack.config.namespace,
                                                stack.config.cluster_token))
    finally:
        if stack is not None:
            stack.stop()
    local = run_local(workload, prompts, args.local_threads)

    print("\n               throughput   TTFT mean/p50/p99 (s)      TBT mean/p50/p99 (s)   batch")
    print(f"stack (HTTP)  {served['tok_s']:8.2f} t/s  {served['ttft_s']['mean']:.2f}/{served['ttft_s']['p50']:.2f}/"
          f"{served['ttft_s']['p99']:.2f}   {served['tbt_s']['mean']:.3f}/{served['tbt_s']['p50']:.3f}/"
          f"{served['tbt_s']['p99']:.3f}   {stats.get('mean_batch_size', float('nan')):.1f}")
    print(f"local engine  {local['tok_s']:8.2f} t/s  {local['ttft_s']['mean']:.2f}/{local['ttft_s']['p50']:.2f}/"
          f"{local['ttft_s']['p99']:.2f}   {local['tbt_s']['mean']:.3f}/{local['tbt_s']['p50']:.3f}/"
          f"{local['tbt_s']['p99']:.3f}   {local['mean_batch_size']:.1f}")
    ratio = served["tok_s"] / local["tok_s"]
    print(f"ratio stack / local engine throughput: {ratio:.2f}")
    print(json.dumps({"stack": {**served, **stats}, "local_engine": local, "ratio_stack_over_local": ratio,
                      "workload": {"requests": len(workload), "scale": args.scale, "time_scale": args.time_scale}}))


if __name__ == "__main__":
    main()
