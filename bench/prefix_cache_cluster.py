"""The cluster part of bench/prefix_cache.py: the Kimi conversation trace through a
stack with two prefill workers, routed by prefix (services.prefill_routing) and then
round robin, one stack after the other with the same requests.

Workload: requests `offset` .. `offset + n - 1` of the trace, every length divided by
`scale` (32: the trace's 512-token blocks become 16-token blocks, the prefix cache's
default block size), prompts capped at `max_prompt` tokens, token ids derived from the
trace's hash ids (equal ids give equal tokens, so a shared prefix is a shared prefix
here too), one output token each, sent in trace order with `concurrency` in flight.
What is measured: prompt tokens the prefill workers computed and served from their
caches (their own figures in the metadata store, NS:stats), and time to first token
(the one-token request's latency at the client, queueing included).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

TRACES = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces"


def load_prompts(n: int, offset: int, scale: int, max_prompt: int) -> list[list[int]]:
    block = 512 // scale
    prompts = []
    with open(TRACES / "kimi_conversation_trace.jsonl") as f:
        for i, line in enumerate(f):
            if i < offset:
                continue
            r = json.loads(line)
            toks: list[int] = []
            for h in r["hash_ids"]:
                toks.extend((h * 1_000_003 + j * 7_919) % 49_000 + 100 for j in range(block))
            prompts.append(toks[:min(max_prompt, max(1, r["input_length"] // scale))])
            if len(prompts) == n:
                break
    return prompts


def ideal_hit_tokens(prompts: list[list[int]], block: int) -> int:
    """Prompt tokens one unbounded cache would serve (whole blocks; the last token computed)."""
    from kvstore.block_hash import block_hashes

    seen: set[str] = set()
    hit = 0
    for p in prompts:
        hashes = block_hashes(p[:-1], block)
        n = next((i for i, h in enumerate(hashes) if h not in seen), len(hashes))
        hit += n * block
        seen.update(block_hashes(p, block))
    return hit


async def _send_all(base_url: str, prompts: list[list[int]], concurrency: int) -> list[float]:
    import openai

    gate = asyncio.Semaphore(concurrency)
    ttft: list[float] = []
    # Closed here, in its own event loop: each routing's run has a loop of its own.
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600) as client:
        model = (await client.models.list()).data[0].id

        async def one(ids: list[int]) -> None:
            async with gate:
                sent = time.perf_counter()
                await client.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0)
                ttft.append(time.perf_counter() - sent)

        await asyncio.gather(*(one(p) for p in prompts))
    return ttft


async def _prefill_figures(config, expected_prompt_tokens: int, timeout_s: float = 30.0) -> dict[str, dict]:
    """Each prefill worker's published figures, once they account for every prompt."""
    from kvstore.metadata import MetadataConfig, MetadataStore

    async with MetadataStore(MetadataConfig(url=config.redis_url, namespace=config.namespace)) as store:
        deadline = time.monotonic() + timeout_s
        while True:
            names = [f"prefill-{i}" for i in range(config.prefill.workers)]
            figures = {n: await store.get_stats("prefill", n) or {"prompt_tokens": 0, "hit_tokens": 0} for n in names}
            if sum(f["prompt_tokens"] for f in figures.values()) >= expected_prompt_tokens:
                return figures
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefill figures short of {expected_prompt_tokens} prompt tokens: {figures}")
            await asyncio.sleep(0.5)  # the workers publish every second: nothing to wait on here


def run_routing(routing: str, prompts: list[list[int]], concurrency: int, workers: int) -> dict:
    """One stack with `workers` prefill workers and `routing`; the replay's figures."""
    from serving import summary

    from services.config import AttentionSection, GatewaySection, PrefillSection, StackConfig
    from services.launcher import Stack

    config = StackConfig(prefill=PrefillSection(workers=workers, routing=routing),
                         attention=AttentionSection(workers=1, kv_capacity_bytes=512 << 20),
                         gateway=GatewaySection(port=_free_port()))
    stack = Stack(config)
    try:
        stack.start(timeout_s=300)
        start = time.perf_counter()
        ttft = asyncio.run(_send_all(stack.base_url, prompts, concurrency))
        seconds = time.perf_counter() - start
        figures = asyncio.run(_prefill_figures(stack.config, sum(len(p) for p in prompts)))
    finally:
        stack.stop()
    prompt_tokens = sum(f["prompt_tokens"] for f in figures.values())
    hit_tokens = sum(f["hit_tokens"] for f in figures.values())
    t = summary(ttft)
    return {"hit_ratio": hit_tokens / prompt_tokens, "computed_tokens": prompt_tokens - hit_tokens,
            "hit_tokens": hit_tokens, "prompt_tokens": prompt_tokens, "ttft_p50_s": t["p50"],
            "ttft_p99_s": t["p99"], "seconds": seconds,
            "per_worker": {n: {"prompt_tokens": f["prompt_tokens"], "hit_tokens": f["hit_tokens"]}
                           for n, f in figures.items()}}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cluster(n: int, offset: int, scale: int, max_prompt: int, concurrency: int, workers: int = 2) -> dict:
    """Prints the workload and each routing's results; returns them with their ratio."""
    prompts = load_prompts(n, offset, scale, max_prompt)
    block = 512 // scale
    total = sum(len(p) for p in prompts)
    ideal = ideal_hit_tokens(prompts, block)
    print(f"\n== cluster: Kimi trace requests {offset}..{offset + len(prompts) - 1}, lengths / {scale} "
          f"(at most {max_prompt} tokens; {total} prompt tokens, mean {total / len(prompts):.0f}), "
          f"1 output token, {concurrency} in flight; {workers} prefill workers, 1 attention worker, "
          f"1 model worker; ideal (one unbounded cache) hit ratio {ideal / total:.4f}", flush=True)
    results = {}
    for routing in ("prefix", "round_robin"):
        r = run_routing(routing, prompts, concurrency, workers)
        results[routing] = r
        print(f"  {routing:11s} computed {r['computed_tokens']:6d} of {r['prompt_tokens']} prompt tokens, hit ratio "
              f"{r['hit_ratio']:.4f}, TTFT p50 {r['ttft_p50_s']:.2f} s p99 {r['ttft_p99_s']:.2f} s, "
              f"{r['seconds']:.1f} s; per worker {r['per_worker']}", flush=True)
    aware, rr = results["prefix"], results["round_robin"]
    ratio = {"computed_tokens": aware["computed_tokens"] / rr["computed_tokens"],
             "ttft_p50": aware["ttft_p50_s"] / rr["ttft_p50_s"]}
    print(f"  prefix / round robin: computed tokens {ratio['computed_tokens']:.3f}x, "
          f"TTFT p50 {ratio['ttft_p50']:.3f}x")
    return {"workload": {"trace": "kimi_conversation_trace", "offset": offset, "requests": len(prompts),
                         "scale": scale, "max_prompt": max_prompt, "prompt_tokens": total,
                         "concurrency": concurrency, "prefill_workers": workers, "ideal_hit_ratio": ideal / total},
            "aware": aware, "round_robin": rr, "ratio": ratio}
