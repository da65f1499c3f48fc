"""Decode pipeline benchmark: the disaggregated stack against the local engine on long decodes.

Workload: B sequences with contexts of C tokens decoding S steps each (greedy, EOS
ignored). The prompts share their first C - 16 tokens and differ in the last 16, so
the stack's prefix cache computes the shared part once; the local engine prefills
every prompt in full. Prefill is not what this compares: decode throughput is
measured from the moment every sequence has its first token.

Compared, in one run:
- the local engine in this process with 1 and with 2 compute threads (the packed
  products' threads; torch's ops on one);
- the stack as `lamina up` starts it (embedded Redis, gateway, scheduler, prefill,
  model worker(s), attention workers, each its own process; tcp by default), over the
  OpenAI API with streaming, with 1, 2 and 3 micro-batches, Q-early on and off at
  2 micro-batches, and the rotational form over M model workers with M + 1
  micro-batches (`--rotational`, default M = 2), and with `--model-threads 1,T` the
  model worker's products on T threads at 1 and 2 micro-batches;
- attention alone, per layer, for the same batch and contexts: the attention
  worker's core (lamina.services.attention_core) against the local engine's attention.

For each stack run it reads the services' Prometheus counters: per process, the CPU
time spent computing and the wall time spent sending, as shares of the run's wall time
(the rest is waiting, or being descheduled on a busy host); the model workers' CPU
milliseconds per generated token (steady however loaded the host is); and the overlap
of model and attention compute, estimated as max(0, model compute + attention compute
- wall) / wall: time in which both computed, exact when neither side sat idle with work
queued, a lower bound otherwise. The local engine reports its CPU ms per token too.

The local engine and the stack hold the linears the same way (`--weights`, default
as_file, the stack's default: the GGUF's packed blocks); `--weights float32,as_file`
repeats everything per choice, side by side.

Prints the machine, the workload and a table; the last line is one JSON object (one
report per weights choice and context under "runs" when there are several).
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
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_throughput import cpu_model  # noqa: E402  (bench/ is not a package)

DISTINCT_TAIL = 16


def make_prompts(tokenizer, batch: int, context: int) -> list[list[int]]:
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing".split()
    shared: list[int] = []
    i = 0
    while len(shared) < context - DISTINCT_TAIL:
        shared.extend(tokenizer.encode(" " + words[i % len(words)]))
        i += 3
    shared = shared[: context - DISTINCT_TAIL]
    prompts = []
    for b in range(batch):
        tail: list[int] = []
        j = b
        while len(tail) < DISTINCT_TAIL:
            tail.extend(tokenizer.encode(f" {words[j % len(words)]}{b}"))
            j += 5
        prompts.append(shared + tail[:DISTINCT_TAIL])
    return prompts


# -- local engine ------------------------------------------------------------------------------
def run_local(loaded, prompts: list[list[int]], steps: int, threads: int) -> dict:
    from lamina.engine import Engine, EngineConfig, SamplingParams
    from lamina.engine.scheduler import SchedulerLimits
    from lamina.model.threads import set_compute_threads

    set_compute_threads(threads)  # the products on `threads` threads, torch's ops on one
    kv_bytes = len(prompts) * (len(prompts[0]) + steps + 64) * loaded.config.kv_bytes_per_token()
    engine = Engine(loaded, EngineConfig(kv_capacity_bytes=kv_bytes,
                                         limits=SchedulerLimits(max_batch_size=len(prompts))))
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    prefilled: set[str] = set()
    while len(prefilled) < len(prompts):  # prefill (and the first token) of every prompt: not timed
        prefilled.update(o.seq_id for o in engine.step())
    tokens = 0
    start, cpu = time.perf_counter(), time.process_time()
    while engine.has_work():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    elapsed = time.perf_counter() - start
    return {"tok_s": tokens / elapsed, "tokens": tokens, "seconds": elapsed,
            "cpu_ms_per_token": 1e3 * (time.process_time() - cpu) / tokens}


# -- attention alone -----------------------------------------------------------------------------
def attention_per_layer(cfg, batch: int, context: int, repeats: int) -> dict:
    """ms per layer of one decode step over `batch` sequences of `context` tokens."""
    import torch

    from lamina.engine.kv import KVStore
    from lamina.engine.step import LocalAttention, StepBatch
    from lamina.services.attention_core import AttentionCore
    from lamina.services.wire import StoreKV

    torch.manual_seed(0)
    hkv, hq, d = cfg.num_kv_heads, cfg.num_heads, cfg.head_dim
    ids = [f"s{i}" for i in range(batch)]
    prompt_k = torch.randn(context, hkv, d)
    prompt_v = torch.randn(context, hkv, d)
    q = torch.randn(batch, hq, d)
    k = torch.randn(batch, hkv, d)
    v = torch.randn(batch, hkv, d)
    need = batch * (context + repeats + 128) * cfg.kv_bytes_per_token()  # with the engine's 64-token chunks

    core = AttentionCore(cfg, need + (64 << 20), hkv)
    for s in ids:
        for layer in range(cfg.num_layers):
            core.store(StoreKV(s, layer, cfg.num_layers, prompt_k, prompt_v))
    seqs = [(s, 1) for s in ids]

    kv = KVStore(cfg, need + (64 << 20))
    for s in ids:
        skv = kv.reserve(s, context + repeats + 1)
        for layer in range(cfg.num_layers):
            skv.write(layer, prompt_k, prompt_v)
        skv.length = context

    worker, engine = [], []
    for r in range(repeats):
        layer = 1 + r % (cfg.num_layers - 1)  # not layer 0: the step's KV is already extended there
        if r == 0:
            core.attend(0, seqs, q, k, v, need_lse=False)
        t = time.perf_counter()
        core.attend(layer, seqs, q, k, v, need_lse=False)
        worker.append(time.perf_counter() - t)
        batch_ = StepBatch.build(ids, [[0]] * batch, [context + r] * batch)
        local = LocalAttention(kv, batch_)
        t = time.perf_counter()
        local.attend(layer, q, k, v)
        engine.append(time.perf_counter() - t)
        local.commit()
    return {"worker": 1e3 * statistics.median(worker), "engine": 1e3 * statistics.median(engine)}


# -- the stack ---------------------------------------------------------------------------------
def _scrape(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.labels:
                out[s.name] = s.value
    return out


async def _metric_ports(redis_url: str, namespace: str) -> dict[str, int]:
    from lamina.kvstore.metadata import MetadataConfig, MetadataStore

    store = MetadataStore(MetadataConfig(url=redis_url, namespace=namespace))
    try:
        ports = {}
        for kind in ("model", "attention"):
            for s in await store.list_services(kind):
                ports[s.service_id] = int(s.meta["metrics_port"])
        return ports
    finally:
        await store.close()


def _counters(ports: dict[str, int]) -> dict[str, dict[str, float]]:
    return {sid: _scrape(p) for sid, p in ports.items()}


async def _drive(url: str, model: str, prompts: list[list[int]], steps: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=1800)
    times: list[list[float]] = [[] for _ in prompts]

    async def one(i: int) -> None:
        stream = await client.completions.create(model=model, prompt=prompts[i], max_tokens=steps + 1,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text is not None:
                times[i].append(time.perf_counter())

    await asyncio.gather(*(one(i) for i in range(len(prompts))))
    await client.close()
    return {"times": times}


def run_stack(prompts: list[list[int]], steps: int, transport: str, micro_batches: int, q_early: bool,
              model_workers: int, kv_bytes: int, weights: str, mode: str = "fixed", attention_workers: int = 2,
              model_threads: int = 1) -> dict:
    import openai

    from lamina.services.config import (AttentionSection, ModelWorkerSection, PipelineSection, SchedulerSection,
                                 StackConfig)
    from lamina.services.launcher import Stack

    config = StackConfig(transport=transport, weights=weights,
                         scheduler=SchedulerSection(max_batch_size=len(prompts), max_queue=max(256, len(prompts))),
                         attention=AttentionSection(workers=attention_workers, kv_capacity_bytes=kv_bytes),
                         model_worker=ModelWorkerSection(workers=model_workers, threads=model_threads),
                         # Exactly the micro-batches asked for, however small they get.
                         pipeline=PipelineSection(micro_batches=micro_batches, q_early=q_early, min_micro_batch=1,
                                                  mode=mode))
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from dataclasses import replace

    from lamina.services.config import GatewaySection

    config = replace(config, gateway=GatewaySection(port=port))
    stack = Stack(config)
    try:
        stack.start()
        model = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused").models.list().data[0].id
        ports = asyncio.run(_metric_ports(stack.config.redis_url, stack.config.namespace))
        # Warm-up: one short request, so the first step's one-time costs are not timed.
        asyncio.run(_drive(stack.base_url, model, prompts[:1], 2))
        # The counters are read when every sequence has its first token, and at the end.
        before: dict = {}

        async def drive_and_mark():
            import openai as _o

            client = _o.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0,
                                    timeout=1800)
            times: list[list[float]] = [[] for _ in prompts]
            all_first = asyncio.Event()

            async def one(i: int) -> None:
                stream = await client.completions.create(model=model, prompt=prompts[i], max_tokens=steps + 1,
                                                         temperature=0, stream=True,
                                                         extra_body={"ignore_eos": True})
                async for chunk in stream:
                    if chunk.choices:
                        times[i].append(time.perf_counter())
                        if len(times[i]) == 1 and all(times):
                            all_first.set()

            async def mark():
                await all_first.wait()
                before.update(await asyncio.to_thread(_counters, ports))
                before["_t"] = time.perf_counter()

            await asyncio.gather(mark(), *(one(i) for i in range(len(prompts))))
            await client.close()
            return times

        times = asyncio.run(drive_and_mark())
        after = _counters(ports)
        t_end = max(t[-1] for t in times)
    finally:
        stack.stop()
    t0 = before["_t"]
    tokens = sum(sum(1 for x in t if x > t0) for t in times)
    wall = t_end - t0
    shares = {}
    for sid in after:
        kind = "model" if sid.startswith("model") else "attention"
        comp = after[sid].get(f"lamina_{kind}_compute_seconds_total", 0) - before[sid].get(
            f"lamina_{kind}_compute_seconds_total", 0)
        send = after[sid].get(f"lamina_{kind}_send_seconds_total", 0) - before[sid].get(
            f"lamina_{kind}_send_seconds_total", 0)
        cpu = after[sid].get("process_cpu_seconds_total", 0) - before[sid].get("process_cpu_seconds_total", 0)
        shares[sid] = {"compute": comp / wall, "send": send / wall, "wait": max(0.0, 1 - (comp + send) / wall),
                       "cpu": cpu / wall}  # cpu: the whole process (event loop, frames, sampling included)
    model_c = sum(v["compute"] for k, v in shares.items() if k.startswith("model"))
    attn_c = sum(v["compute"] for k, v in shares.items() if k.startswith("attention"))
    return {"tok_s": tokens / wall, "tokens": tokens, "seconds": wall, "shares": shares,
            "overlap": max(0.0, model_c + attn_c - 1.0), "cpu_ms_per_token": 1e3 * model_c * wall / tokens}


def _row_name(key: str) -> str:
    if key.startswith("rot"):
        m = int(key[3:])
        return f"stack, rotational, {m} mw x {m + 1} mb"
    mb, _, threads = key[2:].partition("-t")
    return f"stack, {mb} micro-batch(es)" + (f", model worker {threads} threads" if threads else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64, help="sequences (B)")
    ap.add_argument("--contexts", default="512", help="context lengths C, comma-separated")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per sequence (S)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each configuration (medians are reported)")
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--model-workers", type=int, default=1)
    ap.add_argument("--micro-batches", default="1,2,3", help="the stack's micro-batch counts to run")
    ap.add_argument("--model-threads", default="1",
                    help="the model worker's thread counts, comma-separated: each beyond 1 adds runs at 1 and 2 "
                         "micro-batches (rows mb1-tT, mb2-tT)")
    ap.add_argument("--no-q-early", action="store_true", help="skip the Q-early run")
    ap.add_argument("--rotational", default="2",
                    help="model-worker counts M to run the rotational pipeline with (M + 1 micro-batches), "
                         "comma-separated; empty: none")
    ap.add_argument("--quick", action="store_true", help="B=32, C=256, S=16, one run each (a few minutes)")
    ap.add_argument("--full", action="store_true", help="C in 128, 512, 2048 and three runs each")
    ap.add_argument("--weights", default="as_file",
                    help="how the linears hold their weights, in the local engine and the stack alike; "
                         "comma-separated to compare (e.g. float32,as_file); default as_file, the stack's default")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.contexts, args.steps, args.repeats = 32, "256", 16, 1
    if args.full:
        args.contexts, args.repeats = "128,512,2048", 3

    import torch

    from lamina.model.loader import load_model
    from lamina.model.threads import set_compute_threads

    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, {platform.python_implementation()} "
          f"{platform.python_version()}, torch {torch.__version__}")
    reports = []
    runs = [(w, int(c)) for w in args.weights.split(",") for c in args.contexts.split(",")]
    for weights, context in runs:
        loaded = load_model(weights=weights)
        cfg = loaded.config
        prompts = make_prompts(loaded.tokenizer, args.batch, context)
        workload = {"batch": args.batch, "context": context, "steps": args.steps, "transport": args.transport,
                    "model_workers": args.model_workers, "repeats": args.repeats, "weights": weights}
        print(f"\nworkload: {args.batch} sequences x {context}-token contexts (shared but the last "
              f"{DISTINCT_TAIL}), {args.steps} decode steps each, greedy, EOS ignored; weights {weights}; stack over "
              f"{args.transport}, {args.model_workers} model worker(s), 2 attention workers", flush=True)
        kv_bytes = (args.batch * (context + args.steps + 64) * cfg.kv_bytes_per_token()) // 2 + (256 << 20)

        def median_of(fn) -> dict:
            runs = [fn() for _ in range(args.repeats)]
            best = sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]
            return {**best, "runs": [r["tok_s"] for r in runs]}

        local = {}
        for threads in (1, 2):
            local[str(threads)] = median_of(lambda: run_local(loaded, prompts, args.steps, threads))
            print(f"  local engine, {threads} thread(s): {local[str(threads)]['tok_s']:.1f} tok/s", flush=True)
        set_compute_threads(1)
        stack = {}
        for mb in [int(m) for m in args.micro_batches.split(",")]:
            stack[f"mb{mb}"] = median_of(lambda: run_stack(prompts, args.steps, args.transport, mb, False,
                                                           args.model_workers, kv_bytes, weights))
            print(f"  stack, {mb} micro-batch(es): {stack[f'mb{mb}']['tok_s']:.1f} tok/s", flush=True)
        for t in [int(t) for t in args.model_threads.split(",") if int(t) > 1]:
            for mb in (1, 2):
                key = f"mb{mb}-t{t}"
                stack[key] = median_of(lambda: run_stack(prompts, args.steps, args.transport, mb, False,
                                                         args.model_workers, kv_bytes, weights, model_threads=t))
                print(f"  {_row_name(key)}: {stack[key]['tok_s']:.1f} tok/s", flush=True)
        for m in [int(m) for m in args.rotational.split(",") if m]:
            stack[f"rot{m}"] = median_of(lambda: run_stack(prompts, args.steps, args.transport, m + 1, False, m,
                                                           kv_bytes, weights, mode="rotational"))
            print(f"  stack, rotational over {m} model workers: {stack[f'rot{m}']['tok_s']:.1f} tok/s", flush=True)
        q_on = None
        if not args.no_q_early:
            q_on = median_of(lambda: run_stack(prompts, args.steps, args.transport, 2, True, args.model_workers,
                                               kv_bytes, weights))
            print(f"  stack, 2 micro-batches, Q early: {q_on['tok_s']:.1f} tok/s", flush=True)
        attn = attention_per_layer(cfg, args.batch, context, repeats=20)

        print(f"\n{'configuration':34s} {'tok/s':>8s}  {'vs best local':>13s}  {'CPU ms/tok':>10s}  "
              "time shares (compute/send/wait)")
        best_local = max(r["tok_s"] for r in local.values())
        for name, r in [("local engine, 1 thread", local["1"]), ("local engine, 2 threads", local["2"]),
                        *((_row_name(m), stack[m]) for m in stack),
                        *([("stack, 2 micro-batches, Q early", q_on)] if q_on else [])]:
            share = "  ".join(f"{sid} {v['compute']:.2f}/{v['send']:.2f}/{v['wait']:.2f}"
                              for sid, v in sorted(r.get("shares", {}).items()))
            overlap = f"  overlap {r['overlap']:.2f}" if "overlap" in r else ""
            print(f"{name:34s} {r['tok_s']:8.1f}  {r['tok_s'] / best_local:12.2f}x  {r['cpu_ms_per_token']:10.2f}  "
                  f"{share}{overlap}")
        print(f"attention per layer, {args.batch} x {context}: worker core {attn['worker']:.2f} ms, "
              f"local engine {attn['engine']:.2f} ms ({attn['worker'] / attn['engine']:.2f}x)")
        targets = {"attention worker within 1.3x of the engine": attn["worker"] <= 1.3 * attn["engine"]}
        if "mb2" in stack:
            targets["stack mb2 >= best local"] = stack["mb2"]["tok_s"] >= best_local
        if "mb1" in stack and "mb2" in stack:
            targets["mb2 >= 1.3x mb1"] = stack["mb2"]["tok_s"] >= 1.3 * stack["mb1"]["tok_s"]
        for name, ok in targets.items():
            print(f"target {name}: {'met' if ok else 'MISSED'}")
        reports.append({
            "workload": workload,
            "local_tok_s": {k: v["tok_s"] for k, v in local.items()},
            "stack_tok_s": {k: v["tok_s"] for k, v in stack.items()},
            "q_early_tok_s": {"on": q_on["tok_s"], "off": stack["mb2"]["tok_s"]} if q_on and "mb2" in stack else {},
            "attention_ms_per_layer": attn,
            "overlap": {k: v["overlap"] for k, v in stack.items()},
            "shares": {k: v["shares"] for k, v in stack.items()},
            "targets": targets,
        })
    print(json.dumps(reports[0] if len(reports) == 1 else {"runs": reports}))


if __name__ == "__main__":
    main()
