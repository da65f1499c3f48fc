"""The first request after `lamina up`: with the services' warm-up (the default) against
without it (`warm_up: false`, LAMINA_WARM_UP=false).

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
later ones compute the same prompt length. The variants alternate (the order swapped
every try) and the table gives medians over the tries; the stack is stopped after each
try, also on Ctrl-C, SIGTERM or an error.

Prints the machine, the workload, each try, the medians and the ratios (warm / cold, and
each variant's first over its later requests); the last line is one JSON object.

    python bench/first_request.py [--tries 3 --requests 6 --layouts colocated,disaggregated]
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

VARIANTS = {"warm": {"LAMINA_WARM_UP": "true"}, "cold": {"LAMINA_WARM_UP": "false"}}
OUTPUT_TOKENS = 8


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tries", type=int, default=3, help="stack starts per variant and layout, alternated")
    p.add_argument("--requests", type=int, default=6, help="chat requests per start, one after another")
    p.add_argument("--layouts", default="colocated", help="comma-separated: colocated, disaggregated")
    args = p.parse_args(argv)
    if args.tries < 1 or args.requests < 2:
        p.error("--tries needs at least 1 and --requests at least 2 (the first and a later one)")
    return args


async def first_tokens(base_url: str, requests: int, tag: str) -> list[float]:
    """Seconds from each chat request's send to its first chunk with text, one after another."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        model = (await client.models.list()).data[0].id
        times = []
        for i in range(requests):
            messages = [{"role": "system", "content": f"Try {tag}, request {i}: answer briefly."},
                        {"role": "user", "content": "Name a colour."}]
            start = time.perf_counter()
            first = None
            stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=OUTPUT_TOKENS,
                                                          temperature=0, stream=True)
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - start
            if first is None:
                raise RuntimeError(f"request {i} of try {tag} streamed no text")
            times.append(first)
        return times
    finally:
        await client.close()


def one_try(layout: str, variant: str, requests: int, tag: str, log_dir: Path) -> dict:
    started = time.perf_counter()
    with lamina_up(["--layout", layout], log_dir / f"{layout}-{variant}-{tag}.log", env=VARIANTS[variant]) as url:
        start_s = time.perf_counter() - started
        times = asyncio.run(first_tokens(url, requests, tag))
    return {"start_s": start_s, "first_ms": 1000 * times[0], "later_ms": 1000 * statistics.median(times[1:])}


def medians(tries: list[dict]) -> dict:
    return {key: statistics.median(t[key] for t in tries) for key in ("start_s", "first_ms", "later_ms")}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    raise_on_sigterm()
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}, {sys.platform}")
    print(f"workload: lamina up --layout L (SmolLM2-135M-Instruct, weights as_file), then {args.requests} chat "
          f"requests one after another, {OUTPUT_TOKENS} output tokens each, greedy, each with a system message of "
          f"its own (no shared cached prefix); warm: the services' warm-up (default), cold: LAMINA_WARM_UP=false; "
          f"{args.tries} tries each, alternated")
    result: dict = {"machine": cpu_model(), "cores": os.cpu_count(), "requests": args.requests, "layouts": {}}
    with tempfile.TemporaryDirectory(prefix="lamina-first-request-") as tmp:
        for layout in layouts:
            tries: dict[str, list[dict]] = {v: [] for v in VARIANTS}
            for t in range(args.tries):
                order = list(VARIANTS) if t % 2 == 0 else list(reversed(VARIANTS))
                for variant in order:
                    row = one_try(layout, variant, args.requests, f"{layout}-{t}-{variant}", Path(tmp))
                    tries[variant].append(row)
                    print(f"  {layout:13s} try {t} {variant}: start {row['start_s']:5.1f} s, first request's first "
                          f"token {row['first_ms']:6.0f} ms, later ones' (median) {row['later_ms']:5.0f} ms",
                          flush=True)
            med = {v: medians(rows) for v, rows in tries.items()}
            print(f"\n{layout}: medians over {args.tries} tries")
            print(f"  {'variant':8s} {'start s':>8s} {'first ms':>9s} {'later ms':>9s} {'first/later':>12s}")
            for v, m in med.items():
                print(f"  {v:8s} {m['start_s']:8.1f} {m['first_ms']:9.0f} {m['later_ms']:9.0f} "
                      f"{m['first_ms'] / m['later_ms']:11.2f}x")
            ratio = med["warm"]["first_ms"] / med["cold"]["first_ms"]
            print(f"  first request's first token, warm / cold: {ratio:.2f}x; start, warm - cold: "
                  f"{med['warm']['start_s'] - med['cold']['start_s']:+.1f} s\n")
            result["layouts"][layout] = {"tries": tries, "medians": med, "first_warm_over_cold": ratio}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
