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
- the colocated layout (`--colocated-threads`, default 1,2): one model worker attending
  in its own process on the KV it holds, no attention workers, one micro-batch, its
  products on each thread count given;
- attention alone, per layer, for the same batch and contexts: the attention
  worker's core (lamina.services.attention.attention_core) against the local engine's attention.

For each stack run it reads the services' Prometheus counters at the window's start
(every sequence has its first token) and end, W wall seconds apart
(lamina.planner.measure.stack_run.window_shares), and reports shares of W, each of one
kind of time:
- per process, compute: CPU seconds of its serving thread in the slices (model worker,
  lamina_model_compute_seconds_total) or handling frames (attention worker,
  lamina_attention_compute_seconds_total), over W; cpu: the whole process's CPU seconds
  (process_cpu_seconds_total, every thread) over W, the mean number of cores it used (a
  colocated attention service reports its model worker's process); send: wall seconds in
  send calls (lamina_*_send_seconds_total) over W;
- model idle: 1 - the model worker's cpu / its compute threads, at least 0 (the mean
  over model workers): with one thread, the share of W its process was off the core,
  waiting on attention replies or the scheduler, or descheduled by other processes (the
  counters do not tell these apart). What micro-batches can fill is at most this;
- cores busy: the sum of cpu over the model and attention worker processes, the mean
  number of cores they used together (the local engine: its process's CPU seconds over
  its wall seconds). Over 1 says that processes ran at once, not which: two attention
  workers computing together count as much as a model and an attention worker.
The counters do not say when each process computed, so no figure here claims model and
attention compute overlapped in time. The model workers' CPU milliseconds per generated
token are their slices' CPU seconds over the tokens (steady however loaded the host is);
the local engine reports its process's CPU ms per token.

The local engine and the stack hold the linears the same way (`--weights`, default
as_file, the stack's default: the GGUF's packed blocks); `--weights float32,as_file`
repeats everything per choice, side by side.

Prints the machine, the workload and a table; the last line is one JSON object (one
report per weights choice and context under "runs" when there are several).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

from engine_throughput import cpu_model  # bench/'s own (a script's folder is on its path)

# The prompts and the stack run are `lamina profile`'s (lamina.planner.measure.stack_run).
from lamina.planner.measure.stack_run import DISTINCT_TAIL, make_prompts, run_stack


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
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"tok_s": tokens / elapsed, "tokens": tokens, "seconds": elapsed,
            "cpu_ms_per_token": 1e3 * cpu / tokens, "cores_busy": cpu / elapsed}


# -- attention alone -----------------------------------------------------------------------------
def attention_per_layer(cfg, batch: int, context: int, repeats: int, device: str = "cpu",
                        dtype_name: str = "float32") -> dict:
    """ms per layer of one decode step over `batch` sequences of `context` tokens: the
    attention worker's core and the local engine's attention, on `device` in that dtype
    (the native kernels on cpu/float32; on a GPU the Triton kernels of
    lamina.model.paged_decode, over the slab and over the engine's buffers, the core's
    replayed as CUDA graphs as the attention service's are; torch's operators
    elsewhere)."""
    import torch

    from lamina.engine.kv import KVStore
    from lamina.engine.step import in_process_attention
    from lamina.model.batch import StepBatch
    from lamina.planner.measure.kernels import synchronize
    from lamina.services.attention.attention_core import AttentionCore
    from lamina.services.wire import StoreKV

    torch.manual_seed(0)
    hkv, hq, d = cfg.num_kv_heads, cfg.num_heads, cfg.head_dim
    ids = [f"s{i}" for i in range(batch)]
    prompt_k = torch.randn(context, hkv, d)
    prompt_v = torch.randn(context, hkv, d)
    q = torch.randn(batch, hq, d)
    k = torch.randn(batch, hkv, d)
    v = torch.randn(batch, hkv, d)
    dtype = getattr(torch, dtype_name)
    # With the engine's 64-token chunks; KV in the dtype.
    need = batch * (context + repeats + 128) * cfg.kv_bytes_per_token(dtype.itemsize)

    prompt_k, prompt_v = prompt_k.to(dtype), prompt_v.to(dtype)
    # Q, K, V on the device for both sides, as cuda_ipc hands them to the worker: neither
    # timing holds a copy of its inputs.
    q, k, v = (x.to(device, dtype) for x in (q, k, v))
    # As the attention service makes it: on a GPU its decode frames replay CUDA graphs.
    core = AttentionCore(cfg, need + (64 << 20), hkv, device=device, dtype=dtype, cuda_graphs=True)
    for s in ids:
        for layer in range(cfg.num_layers):
            core.store(StoreKV(s, layer, cfg.num_layers, prompt_k, prompt_v))
    seqs = [(s, 1) for s in ids]

    kv = KVStore(cfg, need + (64 << 20), dtype=dtype, device=torch.device(device))
    for s in ids:
        skv = kv.reserve(s, context + repeats + 1)
        for layer in range(cfg.num_layers):
            skv.write(layer, prompt_k, prompt_v)
        skv.length = context

    worker, engine = [], []
    for r in range(repeats):
        layer = 1 + r % (cfg.num_layers - 1)  # not layer 0: the step's KV is already extended there
        if r == 0:  # the step extended, then every layer's graph captured before any is timed
            for warm in range(cfg.num_layers):
                core.attend(warm, seqs, q, k, v, need_lse=False)
        synchronize(torch.device(device))
        # Each side's output copied to the host: that waits for the device, as a reply does.
        t = time.perf_counter()
        core.attend(layer, seqs, q, k, v, need_lse=False)[0].cpu()
        worker.append(time.perf_counter() - t)
        batch_ = StepBatch.build(ids, [[0]] * batch, [context + r] * batch)
        local = in_process_attention(kv, batch_)
        synchronize(torch.device(device))
        t = time.perf_counter()
        local.attend(layer, q, k, v).cpu()
        engine.append(time.perf_counter() - t)
        local.commit()
    return {"worker": 1e3 * statistics.median(worker), "engine": 1e3 * statistics.median(engine)}


def _row_name(key: str) -> str:
    if key.startswith("col"):
        return f"colocated, 1 micro-batch, {key[5:]} thread(s)"
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
    ap.add_argument("--colocated-threads", default="1,2",
                    help="thread counts of the colocated layout's model worker (one run each, one micro-batch); "
                         "empty: none")
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
              f"{args.transport}, {args.model_workers} model worker(s), 2 attention workers (colocated: "
              f"none)", flush=True)
        kv_bytes = (args.batch * (context + args.steps + 64) * cfg.kv_bytes_per_token()) // 2 + (256 << 20)

        def median_of(fn: Callable[..., dict], *fn_args: Any, **fn_kwargs: Any) -> dict:
            runs = [fn(*fn_args, **fn_kwargs) for _ in range(args.repeats)]
            best = sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]
            return {**best, "runs": [r["tok_s"] for r in runs]}

        local = {}
        for threads in (1, 2):
            local[str(threads)] = median_of(run_local, loaded, prompts, args.steps, threads)
            print(f"  local engine, {threads} thread(s): {local[str(threads)]['tok_s']:.1f} tok/s", flush=True)
        set_compute_threads(1)
        stack = {}
        for mb in [int(m) for m in args.micro_batches.split(",")]:
            stack[f"mb{mb}"] = median_of(run_stack, prompts, args.steps, args.transport, mb, False,
                                         args.model_workers, kv_bytes, weights)
            print(f"  stack, {mb} micro-batch(es): {stack[f'mb{mb}']['tok_s']:.1f} tok/s", flush=True)
        for t in [int(t) for t in args.model_threads.split(",") if int(t) > 1]:
            for mb in (1, 2):
                key = f"mb{mb}-t{t}"
                stack[key] = median_of(run_stack, prompts, args.steps, args.transport, mb, False,
                                       args.model_workers, kv_bytes, weights, model_threads=t)
                print(f"  {_row_name(key)}: {stack[key]['tok_s']:.1f} tok/s", flush=True)
        for m in [int(m) for m in args.rotational.split(",") if m]:
            stack[f"rot{m}"] = median_of(run_stack, prompts, args.steps, args.transport, m + 1, False, m,
                                         kv_bytes, weights, mode="rotational")
            print(f"  stack, rotational over {m} model workers: {stack[f'rot{m}']['tok_s']:.1f} tok/s", flush=True)
        for t in [int(t) for t in args.colocated_threads.split(",") if t]:
            key = f"col-t{t}"
            # One attention worker per model worker: each holds the KV two would share.
            stack[key] = median_of(run_stack, prompts, args.steps, args.transport, 1, False, args.model_workers,
                                   2 * kv_bytes, weights, model_threads=t, layout="colocated")
            print(f"  {_row_name(key)}: {stack[key]['tok_s']:.1f} tok/s", flush=True)
        q_on = None
        if not args.no_q_early:
            q_on = median_of(run_stack, prompts, args.steps, args.transport, 2, True, args.model_workers,
                             kv_bytes, weights)
            print(f"  stack, 2 micro-batches, Q early: {q_on['tok_s']:.1f} tok/s", flush=True)
        attn = attention_per_layer(cfg, args.batch, context, repeats=20)

        print(f"\n{'configuration':34s} {'tok/s':>8s}  {'vs best local':>13s}  {'CPU ms/tok':>10s}  "
              f"{'model idle':>10s}  {'cores busy':>10s}  per process: compute (CPU) / cpu (process CPU) / send "
              "(wall), shares of the window")
        best_local = max(r["tok_s"] for r in local.values())
        for name, r in [("local engine, 1 thread", local["1"]), ("local engine, 2 threads", local["2"]),
                        *((_row_name(m), stack[m]) for m in stack),
                        *([("stack, 2 micro-batches, Q early", q_on)] if q_on else [])]:
            share = "  ".join(f"{sid} {v['compute']:.2f}/{v['cpu']:.2f}/{v['send']:.2f}"
                              for sid, v in sorted(r.get("shares", {}).items()))
            idle = f"{r['model_idle']:10.2f}" if "model_idle" in r else " " * 10
            print(f"{name:34s} {r['tok_s']:8.1f}  {r['tok_s'] / best_local:12.2f}x  {r['cpu_ms_per_token']:10.2f}  "
                  f"{idle}  {r['cores_busy']:10.2f}  {share}".rstrip())
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
            "model_idle": {k: v["model_idle"] for k, v in stack.items()},
            "cores_busy": {**{f"local-t{k}": v["cores_busy"] for k, v in local.items()},
                           **{k: v["cores_busy"] for k, v in stack.items()}},
            "shares": {k: v["shares"] for k, v in stack.items()},
            "targets": targets,
        })
    print(json.dumps(reports[0] if len(reports) == 1 else {"runs": reports}))


if __name__ == "__main__":
    main()
