"""A decode through the stack as `lamina up` starts it, timed from the services' own counters.

Every service in its own process (embedded Redis, gateway, scheduler, prefill, model
and attention workers), driven over the OpenAI API with streaming (with aiohttp: the
openai client is not a dependency of the package): one short warm-up request, then B
sequences decoding S steps each (greedy, EOS ignored), their tokens counted by the ids
each streamed event carries (`tokens_in`: an event can carry several). The window starts
when every sequence has its first token (on a GPU, its third: the whole batch's first
decode steps at the prompts' length capture that context bucket's CUDA graphs) and ends at
the last token; with `hold` H, every request
may make S + 1 + H tokens (S + 3 + H on a GPU) and the window ends once each sequence made S tokens in it (the
streams are closed there): the sequences whose prompts were prefilled first keep
decoding to the end, so the whole batch decodes throughout, as a benchmark at batch B
needs (an error where one ended before: H was smaller than the tokens it made while
the last prompts were prefilled). The services' Prometheus counters are read at the
window's start and end, so prefill is not in the figures: per process, the CPU time
spent computing, the wall time spent sending and the whole process's CPU, as shares of
the decode's wall time, and from them the model worker's idle share and the cores the
workers kept busy (`window_shares`). `lamina profile` calibrates the services' overheads
with one small run (planner/profile.py); bench/decode_pipeline.py and
bench/planner_validation.py compare configurations with it.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp

from lamina.model.tokenizer import Tokenizer
from lamina.ports import free_port
from lamina.services.tracing import TRACE_DIR_ENV, TRACE_START, TRACE_STOP

DISTINCT_TAIL = 16  # the prompts' last tokens that differ; the rest is shared


def make_prompts(tokenizer: Tokenizer, batch: int, context: int) -> list[list[int]]:
    """`batch` prompts of `context` tokens that share all but their last DISTINCT_TAIL
    (so the stack's prefix cache computes the shared part once)."""
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards",
             "quietly", "judge", "boxing"]
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


async def metric_ports(redis_url: str, namespace: str) -> dict[str, int]:
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


def read_counters(ports: dict[str, int]) -> dict[str, dict[str, float]]:
    return {sid: _scrape(p) for sid, p in ports.items()}


def _model_id(base_url: str) -> str:
    with urllib.request.urlopen(base_url + "/v1/models", timeout=60) as r:
        return json.loads(r.read())["data"][0]["id"]


def tokens_in(line: bytes) -> int:
    """The generated tokens one server-sent event line of a completion stream carries
    (asked with `return_token_ids`). An event is sent when there is text to send, so one
    can carry several tokens: those whose text was held back (an incomplete UTF-8
    character, a possible stop string's start) come with the next text."""
    text = line.decode().strip()
    if not text.startswith("data: ") or text == "data: [DONE]":
        return 0
    return sum(len(choice.get("token_ids") or ()) for choice in json.loads(text[6:]).get("choices") or ())


async def _stream(session: aiohttp.ClientSession, base_url: str, model: str, prompt: list[int], max_tokens: int,
                  on_tokens: Callable[[int], None]) -> None:
    """One streamed greedy completion over the OpenAI API (EOS ignored); `on_tokens(n)` at
    each event that carries n > 0 generated tokens, as it arrives."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    async with session.post(base_url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:  # server-sent events, one `data: {...}` line each
            if n := tokens_in(line):
                on_tokens(n)


async def _drive(base_url: str, model: str, prompts: list[list[int]], steps: int) -> None:
    """Stream a completion of `steps` + 1 tokens for every prompt at once."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        await asyncio.gather(*(_stream(session, base_url, model, p, steps + 1, lambda n: None) for p in prompts))


async def _set_first(event: asyncio.Event, ended: asyncio.Future) -> bool:
    """Waits until `event` is set or `ended` is done; whether the event is set."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter, ended}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    return event.is_set()


def run_stack(prompts: list[list[int]], steps: int, transport: str, micro_batches: int, q_early: bool,
              model_workers: int, kv_bytes: int, weights: str, mode: str = "fixed", attention_workers: int = 2,
              model_threads: int = 1, layout: str = "disaggregated", model: str | None = None,
              device: str = "cpu", dtype: str = "float32", hold: int = 0,
              trace_dir: Path | None = None, step_graphs: bool = True,
              device_order: bool = False, untimed_steps: int | None = None) -> dict[str, Any]:
    """Decode `steps` tokens after the first for every prompt through a stack of that
    configuration; its decode throughput, wall seconds, each model and attention
    worker's shares of that time and the run's figures from them (`window_shares`), and
    the shares as milliseconds a decode step (`ms_per_step`: a share times the window's
    wall seconds over the steps it timed, its tokens over the sequences; over the layers,
    a layer's).
    `hold`: the extra tokens a request may make so that the whole batch decodes
    throughout the window (the module's docstring); `kv_bytes` must hold them too.
    `trace_dir`: the model and attention workers trace the timed window into it
    (services/tracing.py; without a hold, until the last stream ended). `step_graphs`:
    model_worker.step_graphs (false: a colocated GPU worker replays its slices' graphs only).
    `device_order`: data_plane.cuda_ipc_device_order (cuda_ipc frames ordered on the GPU).
    `untimed_steps`: the decode steps of the whole batch before the window starts
    (default: none on the CPU, 2 on a GPU: the module's docstring)."""
    from lamina.services.config import (
        AttentionSection,
        DataPlaneSection,
        GatewaySection,
        ModelWorkerSection,
        PipelineSection,
        PrefillSection,
        SchedulerSection,
        StackConfig,
    )
    from lamina.services.launch.launcher import Stack

    config = StackConfig(model=model, layout=layout, transport=transport, weights=weights,
                         scheduler=SchedulerSection(max_batch_size=len(prompts), max_queue=max(256, len(prompts))),
                         attention=AttentionSection(workers=attention_workers, kv_capacity_bytes=kv_bytes,
                                                    device=device, dtype=dtype),
                         model_worker=ModelWorkerSection(workers=model_workers, threads=model_threads, device=device,
                                                         dtype=dtype, step_graphs=step_graphs),
                         prefill=PrefillSection(device=device, dtype=dtype),
                         data_plane=DataPlaneSection(cuda_ipc_device_order=device_order),
                         # Exactly the micro-batches asked for, however small they get.
                         pipeline=PipelineSection(micro_batches=micro_batches, q_early=q_early, min_micro_batch=1,
                                                  mode=mode))
    config = replace(config, gateway=GatewaySection(port=free_port()))
    stack = Stack(config, env={TRACE_DIR_ENV: str(trace_dir)} if trace_dir is not None else None)

    def traced() -> list[Any]:
        """The model and attention workers' processes, where the run is traced."""
        return [sp.proc for sp in stack.processes if trace_dir is not None
                and sp.name.startswith(("model-", "attention-")) and sp.proc is not None]

    def signal_traced(sig: int) -> None:
        for proc in traced():
            proc.send_signal(sig)
    try:
        stack.start()
        model = _model_id(stack.base_url)
        if stack.config.redis_url is None:  # start() sets it (the embedded Redis when none was given)
            raise RuntimeError("the stack started without a metadata store")
        ports = asyncio.run(metric_ports(stack.config.redis_url, stack.config.namespace))
        # Warm-up, so the first steps' one-time costs are not timed: one short request; on a
        # GPU the whole batch, short, since each batch size has its own (Triton's compiles of
        # its kernels' variants; CUDA graph captures of its bucket where the workers did not
        # capture them at start, warm_up_graph_keys).
        warm = prompts[:1] if device == "cpu" else [p[:32] for p in prompts]
        asyncio.run(_drive(stack.base_url, model, warm, 2))
        # A GPU's graphs are also per context bucket (lamina.model.step_graphs.context_bucket),
        # which the short warm-up does not reach: past the keys captured at start, the whole
        # batch's first decode steps at the prompts' length capture them (a step of each
        # micro-batch, in whichever order they interleave), so the window starts two steps
        # later there.
        untimed = untimed_steps if untimed_steps is not None else 0 if device == "cpu" else 2
        # The counters are read at the window's start and end.
        before: dict[str, Any] = {}
        after: dict[str, Any] = {}
        window: dict[str, float] = {}

        async def drive_and_mark() -> list[list[tuple[float, int]]]:
            times: list[list[tuple[float, int]]] = [[] for _ in prompts]  # (arrival, tokens) per event
            made = [0] * len(prompts)  # each sequence's tokens so far
            in_window = [0] * len(prompts)  # each sequence's tokens after the window's start
            all_first, full = asyncio.Event(), asyncio.Event()

            def chunk_of(i: int) -> Callable[[int], None]:
                def arrived(n: int) -> None:
                    now = time.perf_counter()
                    times[i].append((now, n))
                    made[i] += n
                    if all_first.is_set():
                        in_window[i] += n
                        if hold and not full.is_set() and min(in_window) >= steps:
                            window["end"] = now
                            full.set()
                    elif min(made) >= 1 + untimed:
                        window["start"] = now
                        all_first.set()

                return arrived

            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
                streams = [asyncio.create_task(_stream(session, stack.base_url, model, prompts[i],
                                                       steps + 1 + untimed + hold, chunk_of(i)))
                           for i in range(len(prompts))]
                ended = asyncio.gather(*streams)
                try:
                    if not await _set_first(all_first, ended):
                        await ended  # a stream's error, if one failed
                        raise RuntimeError(f"the streams ended before every sequence had its first {1 + untimed} "
                                           "token(s)")
                    before.update(await asyncio.to_thread(read_counters, ports))
                    signal_traced(TRACE_START)
                    if hold:
                        if not await _set_first(full, ended):
                            await ended  # a stream's error, if one failed
                            raise RuntimeError(f"a sequence ended before the window did: it made more than hold={hold} "
                                               f"tokens while the last prompts were prefilled (a larger hold, and the "
                                               f"KV for it, would keep it decoding)")
                        after.update(await asyncio.to_thread(read_counters, ports))
                    else:
                        await ended
                    signal_traced(TRACE_STOP)
                finally:
                    for t in streams:
                        t.cancel()  # closes the stream: the gateway aborts the request
                    await asyncio.gather(ended, return_exceptions=True)
            return times

        times = asyncio.run(drive_and_mark())
        if not hold:
            after = read_counters(ports)
            window["end"] = max(t[-1][0] for t in times)
        if trace_dir is not None:
            _wait_for_traces(trace_dir, [proc.pid for proc in traced()])
    finally:
        stack.stop()
    t0, t_end = window["start"], window["end"]
    tokens = sum(n for t in times for at, n in t if t0 < at <= t_end)
    wall = t_end - t0
    if tokens == 0 or wall <= 0:
        raise RuntimeError(f"no token in the timed window ({tokens} tokens, {wall:.6f} s)")
    figures = window_shares(before, after, wall, model_threads, colocated=layout == "colocated")
    steps_timed = tokens / len(prompts)  # each sequence gains a token a step
    return {"tok_s": tokens / wall, "tokens": tokens, "seconds": wall, **figures,
            "cpu_ms_per_token": 1e3 * figures["model_compute_s"] / tokens,
            "ms_per_step": {sid: {k: 1e3 * v * wall / steps_timed for k, v in share.items()}
                            for sid, share in figures["shares"].items()}}


def _wait_for_traces(trace_dir: Path, pids: list[int], timeout_s: float = 300.0) -> None:
    """Returns once each of `pids` wrote its trace's table into `trace_dir` (a service
    writes it after the trace's events, which can take seconds), or raises."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [pid for pid in pids if not any(trace_dir.glob(f"*-pid{pid}-*.txt"))]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"no trace from the workers with pids {missing} in {trace_dir} after {timeout_s:.0f} s "
                               "(their logs say why)")
        time.sleep(0.2)  # another process's file: there is no event to wait on


def window_shares(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], wall: float,
                  model_threads: int = 1, colocated: bool = False) -> dict[str, Any]:
    """What the model and attention workers did in a window of `wall` seconds, from their
    counters read at its start (`before`) and end (`after`), keyed by service id.

    Each share is one counter's increase over `wall`, one kind of time each:
    - compute: CPU seconds of the service's thread computing (the model worker's slices,
      the attention worker's frames; `thread_time`): the share of the window that thread
      computed on a core;
    - send: wall seconds in send calls (an `await`: other micro-batches may compute meanwhile);
    - cpu: CPU seconds of the whole process, every thread (`process_cpu_seconds_total`):
      the mean number of cores it used. A colocated attention service reports its model
      worker's process;
    - device_wait: wall seconds the process's tasks waited for their GPU's work before
      sending (a copy's event polled; 0 on the CPU), summed over the tasks;
    - reply_wait (model workers): wall seconds its micro-batches awaited attention
      replies after sending a layer's frames, summed over the micro-batches.
    The waits are not CPU time: a share over 1 says several tasks waited at once.
    The run's figures, CPU seconds over wall seconds both:
    - model_idle: the model workers' mean of max(0, 1 - cpu / model_threads), the share
      of their compute threads' cores they left unused; with one thread, the share of the
      window the process was off its core: waiting on attention replies or the scheduler,
      or descheduled by other processes (the counters do not tell these apart);
    - cores_busy: the sum of cpu over the distinct processes, model and attention workers
      together: the mean number of cores they kept busy (over 1: two or more processes
      ran at once, whichever they were; the counters do not say when each ran).
    No share adds CPU time to wall time, or tells which work ran at the same time as which."""
    def grew(sid: str, name: str) -> float:
        return after[sid].get(name, 0.0) - before[sid].get(name, 0.0)

    shares = {}
    for sid in after:
        kind = "model" if sid.startswith("model") else "attention"
        shares[sid] = {"compute": grew(sid, f"lamina_{kind}_compute_seconds_total") / wall,
                       "send": grew(sid, f"lamina_{kind}_send_seconds_total") / wall,
                       "cpu": grew(sid, "process_cpu_seconds_total") / wall,
                       "device_wait": grew(sid, f"lamina_{kind}_device_wait_seconds_total") / wall}
        if kind == "model":
            shares[sid]["reply_wait"] = grew(sid, "lamina_model_reply_wait_seconds_total") / wall
    models = [v for k, v in shares.items() if k.startswith("model")]
    processes = models if colocated else list(shares.values())
    return {"shares": shares,
            "model_idle": sum(max(0.0, 1 - v["cpu"] / model_threads) for v in models) / max(1, len(models)),
            "cores_busy": sum(v["cpu"] for v in processes),
            "model_compute_s": sum(v["compute"] for v in models) * wall}
