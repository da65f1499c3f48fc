"""Latency: TTFT, TBT and tokens/s of `lamina up`, the engine in process and llama-server, side by side.

Compared in one run, all started once and kept up, at concurrency 1, 4, 12 and 48:
- llama.cpp's `llama-server` on the model's GGUF file with --threads threads (and
  --threads-batch), one slot per request of the largest concurrency; found or built by
  `bench/llama_cpp.py`;
- `lamina up --layout L --model-threads THREADS` for each layout (disaggregated and
  colocated), weights as the file stores them (`as_file`, lamina up's default); the targets
  are checked on the one `lamina up --layout auto`, its default, chooses on this machine;
- the engine in this process (`Engine`, as_file weights, `set_compute_threads(THREADS)`):
  every request added at once, its step loop driven here, each token's arrival timed.

Workload: C requests at once, each a distinct prompt of P token ids (128; `cpu_anchor.make_prompts`:
"Request i: ..." text, so no two share a prefix), exactly T output tokens (64; `ignore_eos`,
which llama-server accepts too, and the output counted from the servers' usage), greedy. The
servers are driven over the OpenAI API (`/v1/completions`, streamed) by the openai
AsyncOpenAI client, all requests at once: TTFT from sending them to a request's first chunk
with text, TBT every gap between a request's chunks with text (one token each: the tables
give chunks against tokens), tokens/s all output tokens over the time from sending to the
last chunk. The engine's TTFT runs from adding the requests to a sequence's first token,
its TBT between a sequence's tokens (the end of the step that made it). One definition,
`token_timings`, for all. (serving.replay also counts a server's last chunk when it
carries only the finish reason, as llama-server's does: one gap of about 0 per request.) Each (concurrency, pass) gets
prompts of its own, the same ones for every system, so no prefix cache (Lamina's, or
llama-server's slots) holds them from before. The machine is shared and noisy: at each
concurrency every system runs once, then again in the other order (--repeats passes in all,
alternating), and the tables give the medians over the passes. One untimed warm-up request
per system first.

Where a batch-1 decode step's time goes:
- the engine in process, one sequence (a P-token prompt) decoding, three passes: the
  step's wall time (perf_counter around `Engine.step`, nothing instrumented); every call
  into the native kernels timed (the packed products of lamina.model.quant, the attention
  kernel of lamina.model.kv_attention, the slice operators of lamina.model.llama (RMSNorm,
  RoPE, SiLU): a few hundred calls a
  step, cheap to time); torch.profiler recording the torch operators (the durations of the
  top-level ones: an op's children run inside it). Python and the rest is the second
  pass's step less the natives and the torch operators. The profiler adds its cost to
  each op, so torch operators are an upper bound and Python a lower one; the step of each
  pass is printed.
- `lamina up` at concurrency 1, for each layout: the model and attention workers'
  Prometheus counters read before and after the concurrency-1 runs, per model-worker step
  (`lamina_model_steps_total`): the slices' CPU time (`lamina_model_compute_seconds_total`),
  attention's CPU time (`lamina_attention_compute_seconds_total`, on the attention workers,
  or in the model worker when colocated), sending frames (`lamina_model_send_seconds_total`,
  wall), the rest of the model worker's step (`lamina_model_step_seconds` wall less those:
  sampling, frames, transport and attention waits, event loop), and outside the step
  (the measured TBT mean less the step: between steps, scheduling, streaming).

Every process started here (llama-server, each `lamina up` and its services) is stopped on
the way out, also on Ctrl-C, SIGTERM or an error. The last line printed is one JSON object.

    python bench/latency.py [--quick] [--concurrency 1,4,12,48 --prompt-tokens 128 --output-tokens 64
                             --threads 2 --repeats 2 --layouts disaggregated,colocated]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from datetime import date
from itertools import pairwise
from pathlib import Path

# bench/'s own modules import by name (a script's folder is on its path); lamina is the installed project's.
from cpu_anchor import (
    find_llama_server,
    free_port,
    lamina_up,
    make_prompts,
    raise_on_sigterm,
    signals_held,
    stop_process,
    wait_healthy,
)
from engine_throughput import cpu_model
from serving import pct

from lamina.lifetime import child_argv
from lamina.planner.measure.host_load import ForeignCpu
from lamina.planner.measure.stack_run import metric_ports, read_counters

ROOT = Path(__file__).resolve().parent.parent
SLOT_MARGIN = 16  # tokens per llama-server slot beyond prompt and output
LLAMA = "llama_cpp"
ENGINE = "engine"
METRICS = ("ttft_p50", "ttft_p99", "tbt_p50", "tbt_p99", "tbt_mean", "tok_s", "foreign_cores")
COUNTERS = {"steps": "lamina_model_steps_total", "compute": "lamina_model_compute_seconds_total",
            "send": "lamina_model_send_seconds_total", "step_wall": "lamina_model_step_seconds_sum",
            "attention": "lamina_attention_compute_seconds_total"}


# -- pure parts (tests/bench/test_latency.py) ----------------------------------------------------
def latency_row(ttft: list[float], tbt: list[float], tokens: int, seconds: float) -> dict:
    """One run's figures, in seconds (tok/s: tokens / seconds)."""
    return {"ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99), "tbt_p50": pct(tbt, 0.5),
            "tbt_p99": pct(tbt, 0.99), "tbt_mean": statistics.fmean(tbt) if tbt else float("nan"),
            "tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds}


def token_timings(arrivals: Iterable[list[float]], start: float) -> tuple[list[float], list[float]]:
    """Each sequence's token arrival times -> (TTFT per sequence, every gap between tokens)."""
    ttft, tbt = [], []
    for times in arrivals:
        if times:
            ttft.append(times[0] - start)
            tbt.extend(b - a for a, b in pairwise(times))
    return ttft, tbt


def median_row(runs: list[dict]) -> dict:
    """The median of each figure over the passes."""
    return {k: statistics.median(r[k] for r in runs) for k in METRICS}


def pass_order(systems: list[str], pass_index: int) -> list[str]:
    """Every system once, the next pass in the other order."""
    return list(systems) if pass_index % 2 == 0 else list(reversed(systems))


def engine_breakdown(step_s: float, native_s: dict[str, float], torch_ops_s: float) -> list[tuple[str, float]]:
    """(part, seconds per step) of the engine's step: the native kernels, torch's operators,
    and Python and the rest (the step less both; never below 0)."""
    rest = step_s - sum(native_s.values()) - torch_ops_s
    return [*native_s.items(), ("torch operators", torch_ops_s), ("Python and the rest", max(0.0, rest))]


def stack_breakdown(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]],
                    tbt_mean_s: float) -> tuple[list[tuple[str, float]], int]:
    """(part, seconds per model-worker step) of a stack's decode step from its services'
    counters (service id -> metric -> value) before and after, and the measured TBT mean;
    and the number of steps. Attention's CPU time is summed over the attention services."""
    def delta(kind: str, key: str) -> float:
        return sum(after[s].get(COUNTERS[key], 0.0) - before.get(s, {}).get(COUNTERS[key], 0.0)
                   for s in after if s.startswith(kind))

    steps = round(delta("model", "steps"))
    if steps <= 0:
        return [], 0
    compute, send, wall = (delta("model", k) / steps for k in ("compute", "send", "step_wall"))
    attention = delta("attention", "attention") / steps
    return [("model worker: slices (CPU time)", compute), ("attention (CPU time)", attention),
            ("model worker: sending frames", send),
            ("rest of the model worker's step", wall - compute - attention - send),
            ("outside the step (TBT mean - step)", tbt_mean_s - wall)], steps


def check_targets(table: dict[int, dict[str, dict]], engine_step_key: str, up_key: str,
                  up_name: str = "lamina up") -> dict[str, dict]:
    """The issue's targets from the medians (table: concurrency -> system -> row)."""
    out: dict[str, dict] = {}

    def target(name: str, value: float | None, limit: float, at_most: bool) -> None:
        if value is None:
            out[name] = {"value": None, "limit": limit, "met": None}
        else:
            out[name] = {"value": value, "limit": limit, "met": value <= limit if at_most else value >= limit}

    one = table.get(1, {})
    llama = one.get(LLAMA)

    def ratio(row: dict | None, base: dict | None, key: str) -> float | None:
        return row[key] / base[key] if row and base and base[key] else None

    target("engine batch-1 step (TBT p50, c=1) <= 1.2x llama-server TBT p50", ratio(one.get(engine_step_key), llama,
           "tbt_p50"), 1.2, True)
    target(f"{up_name} TBT p50 at c=1 <= 1.3x llama-server", ratio(one.get(up_key), llama, "tbt_p50"), 1.3, True)
    for c in (1, 4, 12):
        row = table.get(c, {})
        target(f"{up_name} tok/s at c={c} >= 0.9x llama-server", ratio(row.get(up_key), row.get(LLAMA), "tok_s"),
               0.9, False)
    return out


# -- the systems ---------------------------------------------------------------------------------
@contextlib.contextmanager
def llama_server(binary: Path, gguf: Path, slots: int, slot_tokens: int, threads: int, log: Path) -> Iterator[str]:
    """llama-server with `slots` slots of `slot_tokens` each, on a free port; yields its base
    URL once healthy, and stops it on the way out."""
    port = free_port()
    argv = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--threads", str(threads),
            "--threads-batch", str(threads), "-np", str(slots), "-c", str(slots * slot_tokens)]
    print(f"  llama-server {' '.join(argv[1:])}", flush=True)
    proc = None
    try:
        with open(log, "w") as f:
            proc = subprocess.Popen(child_argv(argv), stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_healthy(proc, f"http://127.0.0.1:{port}", log)
        yield f"http://127.0.0.1:{port}"
    finally:
        with signals_held():
            stop_process(proc)


def model_id(url: str) -> str:
    import openai

    with openai.OpenAI(base_url=url + "/v1", api_key="unused") as client:
        return client.models.list().data[0].id


async def _stream_all(url: str, model: str, prompts: list[list[int]], output_tokens: int):
    """Every prompt at once, streamed: (start, seconds, each request's arrival times of its
    chunks with text, each request's output tokens by the server's usage)."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    arrivals: list[list[float]] = [[] for _ in prompts]
    tokens = [0] * len(prompts)

    async def one(i: int) -> None:
        stream = await client.completions.create(model=model, prompt=prompts[i], max_tokens=output_tokens,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True},
                                                 stream_options={"include_usage": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                tokens[i] = chunk.usage.completion_tokens
            # Text only: a server's last chunk may carry just the finish reason (llama-server's does).
            if chunk.choices and chunk.choices[0].text:
                arrivals[i].append(now)

    try:
        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(len(prompts))))
        return start, time.perf_counter() - start, arrivals, tokens
    finally:
        await client.close()


def run_server(url: str, model: str, prompts: list[list[int]], output_tokens: int) -> dict:
    """Every prompt at once over the OpenAI API, streamed; each request's output length is checked."""
    start, seconds, arrivals, tokens = asyncio.run(_stream_all(url, model, prompts, output_tokens))
    if any(n != output_tokens for n in tokens):
        raise RuntimeError(f"{url}: output tokens per request {sorted(set(tokens))}, not {output_tokens}")
    row = latency_row(*token_timings(arrivals, start), sum(tokens), seconds)
    return {**row, "chunks": sum(len(a) for a in arrivals)}


def run_engine(engine, prompts: list[list[int]], output_tokens: int) -> dict:
    """Every prompt added at once; each token's arrival is the end of the step that made it."""
    from lamina.engine import SamplingParams

    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    arrivals: dict[str, list[float]] = {engine.add_request(p, params): [] for p in prompts}
    tokens = 0
    while engine.has_work():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            arrivals[out.seq_id].append(now)
            tokens += len(out.new_token_ids)
    seconds = time.perf_counter() - start
    if tokens != len(prompts) * output_tokens:
        raise RuntimeError(f"engine: {tokens} output tokens, not {len(prompts)} x {output_tokens}")
    return latency_row(*token_timings(arrivals.values(), start), tokens, seconds)


async def _stack_ports(url: str) -> dict[str, int]:
    """The metrics ports of the model and attention services of the `lamina up` serving `url`."""
    from lamina.services.config import load_config
    from lamina.services.launch import local_stacks

    path = local_stacks.find(int(url.rsplit(":", 1)[1]))
    if path is None:
        raise RuntimeError(f"no lamina up found for {url}")
    config = load_config(path, env={})  # the stack's own file, as its services read it
    return await metric_ports(config.redis_url, config.namespace)


def timed_run(run, *args) -> dict:
    """run(*args)'s row, with the CPU that processes not started here took meanwhile
    (cores on average: other users of this shared host, and the hypervisor's steal)."""
    others = ForeignCpu()
    row = run(*args)
    return {**row, "foreign_cores": others.cores()}


def auto_layout() -> str:
    """The layout `lamina up` starts here when nothing names one (lamina/commands/up.py)."""
    from lamina.commands.plan import DEFAULT_PROFILE
    from lamina.commands.up import choose_layout
    from lamina.services.config import load_config

    choice = choose_layout(load_config(env={}), None, DEFAULT_PROFILE)
    return choice.layout if choice is not None else "disaggregated"


# -- the engine's step, taken apart ---------------------------------------------------------------
class _TimedNative:
    """A native module's stand-in whose functions add their wall time to `totals[part]`."""

    def __init__(self, module, totals: dict[str, float], part: str) -> None:
        self._module, self._totals, self._part = module, totals, part
        self._fns: dict[str, object] = {}

    def __getattr__(self, name: str):
        fn = self._fns.get(name)
        if fn is None:
            inner = getattr(self._module, name)

            def fn(*args, _inner=inner):
                t = time.perf_counter()
                try:
                    return _inner(*args)
                finally:
                    self._totals[self._part] += time.perf_counter() - t

            self._fns[name] = fn
        return fn


@contextlib.contextmanager
def native_calls_timed(totals: dict[str, float]) -> Iterator[None]:
    """Every call into the native kernels the engine's step makes is timed, by part."""
    from lamina.model import fused_slice, kv_attention, llama, quant

    patched = [(quant, "NATIVE", "packed products (native)"), (kv_attention, "NATIVE", "attention kernel (native)"),
               (llama, "_SLICE_OPS", "slice operators (native)"),
               (fused_slice, "NATIVE", "fused middle slices (native products and operators)")]
    saved = []
    for module, name, part in patched:
        totals.setdefault(part, 0.0)
        original = getattr(module, name)
        if original is not None:  # not built: that part runs in torch and counts as torch operators
            saved.append((module, name, original))
            setattr(module, name, _TimedNative(original, totals, part))
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def engine_step_parts(engine, prompt: list[int], steps: int) -> dict:
    """One sequence decoding `steps` steps three times: plain (the step's wall time); with
    every native call timed (cheap: a few hundred calls a step); with torch.profiler on
    (the torch operators' time). Per step: means over each pass's steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from lamina.engine import SamplingParams

    def decode(around) -> list[float]:
        engine.add_request(prompt, SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
        engine.step()  # the prompt's step is not a decode step
        walls = []
        with around:
            while engine.has_work():
                t = time.perf_counter()
                engine.step()
                walls.append(time.perf_counter() - t)
        return walls

    plain = decode(contextlib.nullcontext())
    totals: dict[str, float] = {}
    timed = decode(native_calls_timed(totals))
    prof = profile(activities=[ProfilerActivity.CPU])
    profiled = decode(prof)  # the decode steps only
    top = [e for e in prof.events() if e.cpu_parent is None]  # an op's children run inside it
    return {"plain_step_s": statistics.median(plain), "plain_step_mean_s": statistics.fmean(plain),
            "step_s": statistics.fmean(timed), "native_s": {part: t / len(timed) for part, t in totals.items()},
            "torch_ops_s": sum(e.time_range.elapsed_us() for e in top) * 1e-6 / len(profiled),
            "profiled_step_s": statistics.fmean(profiled), "torch_ops_per_step": len(top) / len(profiled),
            "steps": len(timed), "torch_threads": torch.get_num_threads()}


# -- printing ------------------------------------------------------------------------------------
def _ms(s: float | None) -> str:
    return f"{s * 1e3:8.1f}" if s is not None else f"{'-':>8s}"


def print_table(c: int, rows: dict[str, dict], names: dict[str, str], passes: int) -> None:
    llama = rows.get(LLAMA)
    print(f"\nconcurrency {c} (medians of {passes} pass(es); ms, tok/s; ratios: this / llama-server; other: "
          f"cores that processes not started here took during the run)")
    print(f"{'system':34s} {'TTFT p50':>8s} {'TTFT p99':>8s} {'TBT p50':>8s} {'TBT p99':>8s} {'TBT mean':>8s} "
          f"{'tok/s':>8s}  {'TBT p50 x':>9s} {'tok/s x':>8s} {'other':>6s}")
    for key, r in rows.items():
        tbt_x = f"{r['tbt_p50'] / llama['tbt_p50']:8.2f}x" if llama else f"{'-':>9s}"
        tok_x = f"{r['tok_s'] / llama['tok_s']:7.2f}x" if llama else f"{'-':>8s}"
        print(f"{names[key]:34s} {_ms(r['ttft_p50'])} {_ms(r['ttft_p99'])} {_ms(r['tbt_p50'])} {_ms(r['tbt_p99'])} "
              f"{_ms(r['tbt_mean'])} {r['tok_s']:8.1f}  {tbt_x} {tok_x} {r['foreign_cores']:6.2f}")


def print_breakdown(title: str, parts: list[tuple[str, float]], total_s: float, how: str) -> None:
    print(f"\n{title}\n  {'part':42s} {'ms/step':>8s} {'share':>6s}")
    print(f"  {'whole (' + how + ')':42s} {_ms(total_s)} {'100%':>6s}")
    for name, s in parts:
        print(f"  {name:42s} {_ms(s)} {s / total_s:6.0%}")


# -- main ----------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,4,12,48", help="requests at once, comma-separated")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompt length in tokens (P)")
    ap.add_argument("--output-tokens", type=int, default=64, help="output tokens per request, forced (T)")
    ap.add_argument("--threads", type=int, default=2,
                    help="llama-server --threads, lamina up --model-threads, the engine's compute threads")
    ap.add_argument("--repeats", type=int, default=2, help="passes per concurrency, alternating the order")
    ap.add_argument("--layouts", default="disaggregated,colocated", help="lamina up layouts, comma-separated")
    ap.add_argument("--breakdown-steps", type=int, default=64, help="decode steps per pass of the engine's breakdown")
    ap.add_argument("--skip-llama", action="store_true", help="no llama-server (no ratios, no targets)")
    ap.add_argument("--quick", action="store_true", help="concurrency 1 and 4, 32 output tokens, 32 breakdown steps")
    args = ap.parse_args()
    if args.quick:
        args.concurrency, args.output_tokens, args.breakdown_steps = "1,4", 32, 32
    levels = [int(c) for c in args.concurrency.split(",")]
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    raise_on_sigterm()

    from lamina.engine import Engine
    from lamina.model.checkpoints import load_tokenizer, resolve_checkpoint
    from lamina.model.loader import load_model
    from lamina.model.threads import set_compute_threads

    gguf = resolve_checkpoint(None)[0]
    tokenizer, _ = load_tokenizer(gguf)
    rounds = [(c, p) for c in levels for p in range(args.repeats)]
    # Prompts of their own for each round, the warm-ups and the breakdown: no cache holds them.
    pool = iter(make_prompts(tokenizer, sum(c for c, _ in rounds) + 2, args.prompt_tokens))
    prompts = {r: [next(pool) for _ in range(r[0])] for r in rounds}
    warm_prompt, breakdown_prompt = next(pool), next(pool)
    load_before = os.getloadavg()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, load average "
          f"{' '.join(f'{x:.2f}' for x in load_before)} (1/5/15 min); {date.today()}; commit {commit}")
    print(f"model: {gguf}")
    print(f"workload: concurrency {', '.join(map(str, levels))}; {args.prompt_tokens}-token prompts (token ids, "
          f"distinct), exactly {args.output_tokens} output tokens each (ignore_eos), greedy, streamed; "
          f"{args.threads} threads each; {args.repeats} pass(es) per concurrency, alternating order", flush=True)

    binary, llama_version, llama_why = find_llama_server(args.skip_llama, "its rows")

    names = {LLAMA: f"llama-server, {args.threads} threads"}  # the tables' order
    names.update({f"up_{x}": f"lamina up, {x}" for x in layouts})
    names[ENGINE] = f"engine in process, {args.threads} threads"
    # The targets are the default layout's: the one `lamina up --layout auto` chooses here
    # (ranked on this machine's profile; measured first if there is none), else the first run.
    default_layout = auto_layout()
    up_key = f"up_{default_layout}" if default_layout in layouts else (f"up_{layouts[0]}" if layouts else None)
    runs: dict[tuple[int, str], list[dict]] = {}
    counters: dict[str, tuple[dict, dict]] = {}  # layout key -> (before, after) around the c=1 runs
    parts: dict = {}
    with tempfile.TemporaryDirectory(prefix="latency-") as tmp, contextlib.ExitStack() as started:
        log_dir = Path(tmp)
        try:
            urls: dict[str, str] = {}
            if binary is not None:
                urls[LLAMA] = started.enter_context(llama_server(
                    binary, gguf, max(levels), args.prompt_tokens + args.output_tokens + SLOT_MARGIN, args.threads,
                    log_dir / "llama-server.log"))
            for x in layouts:
                urls[f"up_{x}"] = started.enter_context(lamina_up(
                    ["--layout", x, "--model-threads", str(args.threads)], log_dir / f"lamina-up-{x}.log"))
            ports = {key: asyncio.run(_stack_ports(url)) for key, url in urls.items() if key.startswith("up_")}
            models = {key: model_id(url) for key, url in urls.items()}
            for key, url in urls.items():  # warm-up: first-request costs are not timed
                run_server(url, models[key], [warm_prompt], 4)
            set_compute_threads(args.threads)  # the products on THREADS threads, torch's ops on one
            engine = Engine(load_model(weights="as_file"))
            run_engine(engine, [warm_prompt], 4)
            systems = [*urls, ENGINE]

            for c, p in rounds:
                if c == 1 and p == 0:
                    before = {key: read_counters(ports[key]) for key in ports}
                for key in pass_order(systems, p):
                    if key == ENGINE:
                        r = timed_run(run_engine, engine, prompts[(c, p)], args.output_tokens)
                    else:
                        r = timed_run(run_server, urls[key], models[key], prompts[(c, p)], args.output_tokens)
                    runs.setdefault((c, key), []).append(r)
                    print(f"  c={c} pass {p + 1}: {names[key]}: TTFT p50 {r['ttft_p50'] * 1e3:.1f} ms, TBT p50 "
                          f"{r['tbt_p50'] * 1e3:.1f} ms, {r['tok_s']:.1f} tok/s; other processes "
                          f"{r['foreign_cores']:.2f} cores"
                          + (f" ({r['chunks']} chunks with text for {r['tokens']} tokens: TBT gaps span several)"
                             if r.get("chunks", r["tokens"]) != r["tokens"] else ""), flush=True)
                if c == 1 and p == args.repeats - 1:
                    counters = {key: (before[key], read_counters(ports[key])) for key in ports}
            parts = engine_step_parts(engine, breakdown_prompt, args.breakdown_steps)
        except KeyboardInterrupt:
            print("interrupted: every process started here is stopped", file=sys.stderr)
            raise SystemExit(130) from None
        print("stopping the servers...", flush=True)
    load_after = os.getloadavg()

    table = {c: {key: median_row(runs[(c, key)]) for key in names if (c, key) in runs} for c in levels}
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in load_after)}")
    for c in levels:
        print_table(c, table[c], names, args.repeats)

    eng_parts = engine_breakdown(parts["step_s"], parts["native_s"], parts["torch_ops_s"])
    print_breakdown(f"batch-1 decode step, engine in process ({parts['steps']} steps a pass; uninstrumented step: "
                    f"median {parts['plain_step_s'] * 1e3:.1f} ms, mean {parts['plain_step_mean_s'] * 1e3:.1f} ms; "
                    f"native calls timed in a second pass; torch operators by torch.profiler in a third, "
                    f"{parts['torch_ops_per_step']:.0f} top-level ops a step, whose step took "
                    f"{parts['profiled_step_s'] * 1e3:.1f} ms: the profiler's cost, part of it inside the ops' "
                    f"durations, so torch operators are an upper bound and Python a lower one)", eng_parts,
                    parts["step_s"], "mean step, natives timed")
    stack_parts = {}
    for key, (b, a) in counters.items():
        tbt_mean = statistics.fmean(r["tbt_mean"] for r in runs[(1, key)])
        rows, steps = stack_breakdown(b, a, tbt_mean)
        stack_parts[key] = {"parts_ms": {n: s * 1e3 for n, s in rows}, "steps": steps, "tbt_mean_ms": tbt_mean * 1e3}
        print_breakdown(f"batch-1 decode step, {names[key]}, concurrency 1 (services' counters over the c=1 runs: "
                        f"{steps} model-worker steps)", rows, tbt_mean, "TBT mean, measured by the client")

    measured = {k for row in table.values() for k in row}
    targets = check_targets(table, ENGINE, up_key, names[up_key]) if LLAMA in measured and up_key else {}
    print()
    for name, t in targets.items():
        verdict = "not measured" if t["met"] is None else ("met" if t["met"] else "MISSED")
        value = "" if t["value"] is None else f" ({t['value']:.2f}x)"
        print(f"target {name}: {verdict}{value}")
    print(json.dumps({
        "table": {c: {key: {k: round(v, 5) for k, v in r.items()} for key, r in rows.items()}
                  for c, rows in table.items()},
        "engine_breakdown_ms": {n: s * 1e3 for n, s in eng_parts} | {
            "step_natives_timed": parts["step_s"] * 1e3, "step_plain_median": parts["plain_step_s"] * 1e3,
            "step_profiled": parts["profiled_step_s"] * 1e3, "torch_ops_per_step": parts["torch_ops_per_step"]},
        "stack_breakdown": stack_parts, "targets": targets, "systems": names,
        "llama_cpp_unavailable": llama_why, "llama_server_version": llama_version,
        "workload": {"concurrency": levels, "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
                     "threads": args.threads, "repeats": args.repeats, "layouts": layouts, "quick": args.quick},
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "load_before": load_before,
                    "load_after": load_after},
        "date": str(date.today()), "commit": commit,
    }))


if __name__ == "__main__":
    main()
