"""The first request after `lamina up`: with the services' warm-up (the default) against
without it (`warm_up: false`, LAMINA_WARM_UP=false), and on a GPU against the warm-up
without its CUDA graph captures (`lazy`: LAMINA_WARM_UP_GRAPH_KEYS=0, each graph captured
at the first step that needs it).

Without a warm-up the first request paid for what the services start lazily: the
gateway's pass over the vocabulary and the chat template's compilation, each worker's
first forward (its compute threads, the kernels' first calls); on two cores it waited
313 ms for its first token against 53-90 ms for the next ones. With it, each prefill and
model worker runs one made-up forward and the gateway its tokenizer's first encodes
before they serve (services/warm_up.py).

Each try starts `lamina up --layout L` (weights as the file holds them, the model
SmolLM2-135M-Instruct), times its start (the command's start to its "serving" line),
then sends --requests chat requests one after another over the OpenAI API (the openai
client, streamed, 8 output tokens each) and times each one's first token (the first
chunk with text). Each request has a system message of its own at the start of its
prompt, so none finds another's blocks in the prefix cache: the first request and the
later ones compute the same prompt length. Each request's longest wait between two
chunks (after its first token) is kept too: a decode step that waits for a CUDA graph's
capture shows there. With --burst N, N more requests then go at once (each sequence
joining makes the batch grow through the batch buckets, each a capture of its own where
none was made at start), and the longest wait between two chunks of any of them is
kept. The variants alternate (the order reversed every try) and the table gives medians
over the tries; the stack is stopped after each try, also on Ctrl-C, SIGTERM or an error.

Prints the machine, the workload, each try, the medians and the ratios (warm / cold, each
variant's first over its later requests, and on a GPU the longest wait between chunks,
warm / lazy); the last line is one JSON object.

    python bench/first_request.py [--tries 3 --requests 6 --layouts colocated,disaggregated]
    python bench/first_request.py --device cuda --burst 32   # variants warm, lazy and cold
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from cpu_anchor import lamina_up, raise_on_sigterm  # bench/: lamina up on a free port, stopped on the way out
from engine_throughput import cpu_model

VARIANTS = {"warm": {"LAMINA_WARM_UP": "true"}, "lazy": {"LAMINA_WARM_UP": "true", "LAMINA_WARM_UP_GRAPH_KEYS": "0"},
            "cold": {"LAMINA_WARM_UP": "false"}}
OUTPUT_TOKENS = 8


def variants_for(device: str) -> list[str]:
    """The variants a run compares: `lazy` only where CUDA graphs are captured (a GPU); on
    the CPU it is `warm` again."""
    return ["warm", "lazy", "cold"] if device != "cpu" else ["warm", "cold"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tries", type=int, default=3, help="stack starts per variant and layout, alternated")
    p.add_argument("--requests", type=int, default=6, help="chat requests per start, one after another")
    p.add_argument("--layouts", default="colocated", help="comma-separated: colocated, disaggregated")
    p.add_argument("--device", default="cpu", help="lamina up --device (cuda: the variant lazy too)")
    p.add_argument("--burst", type=int, default=0,
                   help="after the one-by-one requests, this many at once (their longest wait between two chunks)")
    args = p.parse_args(argv)
    if args.tries < 1 or args.requests < 2 or args.burst < 0:
        p.error("--tries needs at least 1, --requests at least 2 (the first and a later one), --burst 0 or more")
    if args.device != "cpu":
        import torch

        if not torch.cuda.is_available():
            p.error(f"--device {args.device}: torch finds no CUDA device here (torch {torch.__version__})")
    return args


async def _stream(client, model: str, tag: str) -> tuple[float, float]:
    """One chat request, streamed: seconds to its first chunk with text, and the longest
    wait between two chunks after it (0 with one chunk)."""
    messages = [{"role": "system", "content": f"{tag}: answer briefly."},
                {"role": "user", "content": "Name a colour."}]
    start = time.perf_counter()
    first = last = None
    gap = 0.0
    stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=OUTPUT_TOKENS,
                                                  temperature=0, stream=True)
    async for chunk in stream:
        now = time.perf_counter()
        if first is None:
            if chunk.choices and chunk.choices[0].delta.content:
                first = last = now
            continue
        assert last is not None
        gap, last = max(gap, now - last), now
    if first is None:
        raise RuntimeError(f"{tag} streamed no text")
    return first - start, gap


async def first_tokens(base_url: str, requests: int, tag: str, burst: int = 0) -> dict[str, list[float]]:
    """Each chat request's first token and longest wait between chunks (seconds), one
    after another (`first`, `gap`), then `burst` at once (`burst_gap`: each one's longest)."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        model = (await client.models.list()).data[0].id
        firsts, gaps = [], []
        for i in range(requests):
            first, gap = await _stream(client, model, f"Try {tag}, request {i}")
            firsts.append(first)
            gaps.append(gap)
        together = await asyncio.gather(*(_stream(client, model, f"Try {tag}, burst {i}") for i in range(burst)))
        return {"first": firsts, "gap": gaps, "burst_gap": [g for _, g in together]}
    finally:
        await client.close()


def one_try(layout: str, variant: str, requests: int, tag: str, log_dir: Path, device: str = "cpu",
            burst: int = 0) -> dict:
    started = time.perf_counter()
    options = ["--layout", layout, *(["--device", device] if device != "cpu" else [])]
    with lamina_up(options, log_dir / f"{layout}-{variant}-{tag}.log", env=VARIANTS[variant]) as url:
        start_s = time.perf_counter() - started
        times = asyncio.run(first_tokens(url, requests, tag, burst))
    row = {"start_s": start_s, "first_ms": 1000 * times["first"][0],
           "later_ms": 1000 * statistics.median(times["first"][1:]), "first_gap_ms": 1000 * times["gap"][0],
           "later_gap_ms": 1000 * statistics.median(times["gap"][1:])}
    if burst:
        row["burst_gap_ms"] = 1000 * max(times["burst_gap"])
    return row


def machine_device(device: str) -> str:
    """The device the stack computes on, in words (the GPU's name where it is one; parse_args
    refused a CUDA device torch does not find)."""
    if device == "cpu":
        return "cpu"
    import torch

    return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"


def medians(tries: list[dict]) -> dict:
    return {key: statistics.median(t[key] for t in tries) for key in tries[0]}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    raise_on_sigterm()
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    variants = variants_for(args.device)
    device = machine_device(args.device)
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}, {sys.platform}; "
          f"device: {device}")
    on = "" if args.device == "cpu" else f" --device {args.device}"
    lazy = "lazy: the warm-up without CUDA graph captures (LAMINA_WARM_UP_GRAPH_KEYS=0), " if "lazy" in variants else ""
    at_once = f", then {args.burst} at once" if args.burst else ""
    print(f"workload: lamina up --layout L{on} (SmolLM2-135M-Instruct), then {args.requests} chat requests one "
          f"after another{at_once}, {OUTPUT_TOKENS} output tokens each, greedy, each with a system message of its own "
          f"(no shared cached prefix); warm: the services' warm-up (default), {lazy}cold: LAMINA_WARM_UP=false; "
          f"{args.tries} tries each, alternated")
    result: dict = {"machine": cpu_model(), "cores": os.cpu_count(), "device": device, "requests": args.requests,
                    "burst": args.burst, "layouts": {}}
    with tempfile.TemporaryDirectory(prefix="lamina-first-request-") as tmp:
        for layout in layouts:
            tries: dict[str, list[dict]] = {v: [] for v in variants}
            for t in range(args.tries):
                order = variants if t % 2 == 0 else list(reversed(variants))
                for variant in order:
                    row = one_try(layout, variant, args.requests, f"{layout}-{t}-{variant}", Path(tmp), args.device,
                                  args.burst)
                    tries[variant].append(row)
                    burst_gap = f", the burst's longest gap {row['burst_gap_ms']:5.0f} ms" if args.burst else ""
                    print(f"  {layout:13s} try {t} {variant}: start {row['start_s']:5.1f} s, first request's first "
                          f"token {row['first_ms']:6.0f} ms (longest gap {row['first_gap_ms']:4.0f} ms), later ones' "
                          f"(median) {row['later_ms']:5.0f} ms ({row['later_gap_ms']:4.0f} ms){burst_gap}", flush=True)
            med = {v: medians(rows) for v, rows in tries.items()}
            print(f"\n{layout}: medians over {args.tries} tries")
            print(f"  {'variant':8s} {'start s':>8s} {'first ms':>9s} {'later ms':>9s} {'first/later':>12s} "
                  f"{'first gap':>10s} {'later gap':>10s}{'  burst gap' if args.burst else ''}")
            for v, m in med.items():
                burst_gap = f" {m['burst_gap_ms']:10.0f}" if args.burst else ""
                print(f"  {v:8s} {m['start_s']:8.1f} {m['first_ms']:9.0f} {m['later_ms']:9.0f} "
                      f"{m['first_ms'] / m['later_ms']:11.2f}x {m['first_gap_ms']:10.0f} {m['later_gap_ms']:10.0f}"
                      f"{burst_gap}")
            ratio = med["warm"]["first_ms"] / med["cold"]["first_ms"]
            print(f"  first request's first token, warm / cold: {ratio:.2f}x; start, warm - cold: "
                  f"{med['warm']['start_s'] - med['cold']['start_s']:+.1f} s")
            entry = {"tries": tries, "medians": med, "first_warm_over_cold": ratio}
            if "lazy" in med:
                key = "burst_gap_ms" if args.burst else "first_gap_ms"
                entry["gap_warm_over_lazy"] = med["warm"][key] / med["lazy"][key]
                print(f"  longest wait between two chunks ({'the burst' if args.burst else 'first request'}), "
                      f"graphs captured at start / lazily: {entry['gap_warm_over_lazy']:.2f}x; start, warm - lazy: "
                      f"{med['warm']['start_s'] - med['lazy']['start_s']:+.1f} s")
            print()
            result["layouts"][layout] = entry
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
