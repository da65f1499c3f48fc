"""The cluster part of bench/prefix_cache.py: the Kimi conversation trace through a
stack with two prefill workers, one stack after the other with the same requests:

    aware        routed by prefix (lamina.services.scheduler.prefill_routing)
    round_robin  each worker in turn
    none         round robin with no prefix cache (every prompt token computed)
    round_robin_fetch  round robin, the chosen worker fetching a longer prefix from its
                 peer (prefill.peer_fetch always; lamina.services.prefill.prefix_peers)

The first three run with peer fetching off, so each is what its routing alone gives.

`run_prefetch` compares instead the prefill workers' prefetcher on and off
(`prefill.prefetch`; lamina.kvstore.prefetch) under prefix routing, with device tiers of
`device_blocks` blocks (fewer than the sample's, at least the longest prompt's) and host
tiers that hold the sample: the stacks run alternately, on then off, then off then on in
the next round, and each setting's TTFT percentiles are of all its rounds' requests.

Workload (`sample`): `conversations` (default) takes the trace's conversations (its
requests grouped by their second block id: the first, hash id 0, begins every request)
with at least `min_turns` requests, in the order they begin, until about `n` requests,
and replays their requests in trace order; `window` takes requests `offset` ..
`offset + n - 1` as they come (a conversation's later turns come about 1,000 requests
apart in the trace, so a short window holds almost none). Every length is divided by
`scale` (32: the trace's 512-token blocks become 16-token blocks, the prefix cache's
default block size), prompts are capped at `max_prompt` tokens, token ids are derived
from the trace's hash ids (equal ids give equal tokens, so a shared prefix is a shared
prefix here too); one output token each, `concurrency` in flight.
What is measured: prompt tokens the prefill workers computed, served from their caches
and fetched from peers (their own figures in the metadata store, NS:stats), and time to
first token (the one-token request's latency at the client, queueing included).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path

TRACES = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces"


def _trace() -> list[dict]:
    with open(TRACES / "kimi_conversation_trace.jsonl") as f:
        return [json.loads(line) for line in f]


def _tokens(r: dict, scale: int, max_prompt: int) -> list[int]:
    block = 512 // scale
    toks: list[int] = []
    for h in r["hash_ids"]:
        toks.extend((h * 1_000_003 + j * 7_919) % 49_000 + 100 for j in range(block))
    return toks[:min(max_prompt, max(1, r["input_length"] // scale))]


def select(trace: list[dict], sample: str, n: int, offset: int, min_turns: int, max_blocks: int) -> list[int]:
    """Indices of the trace requests to replay, in trace order."""
    if sample == "window":
        return list(range(offset, min(offset + n, len(trace))))
    if sample != "conversations":
        raise ValueError(f"unknown sample {sample!r}: conversations or window")
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(trace):
        if len(r["hash_ids"]) >= 2:
            groups.setdefault(r["hash_ids"][1], []).append(i)
    chosen: list[int] = []
    for members in groups.values():  # in the order the conversations begin
        if len(members) >= min_turns and all(len(trace[i]["hash_ids"]) <= max_blocks for i in members):
            chosen += members
            if len(chosen) >= n:
                break
    return sorted(chosen)


def load_prompts(n: int, offset: int, scale: int, max_prompt: int, sample: str = "window",
                 min_turns: int = 4) -> list[list[int]]:
    trace = _trace()
    indices = select(trace, sample, n, offset, min_turns, max_blocks=max_prompt * scale // 512)
    return [_tokens(trace[i], scale, max_prompt) for i in indices]


def ideal_hit_tokens(prompts: list[list[int]], block: int, workers: int = 1) -> int:
    """Prompt tokens unbounded caches would serve (whole blocks; the last token computed):
    with `workers` = 1 one cache that sees every prompt, the most any routing over
    several caches can serve without fetching; with more, one cache per worker and the
    prompts dealt round robin."""
    from lamina.kvstore.block_hash import block_hashes

    seen: list[set[str]] = [set() for _ in range(workers)]
    hit = 0
    for i, p in enumerate(prompts):
        cache = seen[i % workers]
        hashes = block_hashes(p[:-1], block)
        n = next((j for j, h in enumerate(hashes) if h not in cache), len(hashes))
        hit += n * block
        cache.update(block_hashes(p, block))
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
    from lamina.kvstore.metadata import MetadataConfig, MetadataStore

    async with MetadataStore(MetadataConfig(url=config.redis_url, namespace=config.namespace)) as store:
        deadline = time.monotonic() + timeout_s
        while True:
            names = [f"prefill-{i}" for i in range(config.prefill.workers)]
            figures = {n: await store.get_stats("prefill", n) or {"prompt_tokens": 0, "hit_tokens": 0} for n in names}
            for f in figures.values():
                f.setdefault("fetched_tokens", 0)
            if sum(f["prompt_tokens"] for f in figures.values()) >= expected_prompt_tokens:
                return figures
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefill figures short of {expected_prompt_tokens} prompt tokens: {figures}")
            await asyncio.sleep(0.5)  # the workers publish every second: nothing to wait on here


# arm -> (routing, prefix cache on, peer fetch)
ARMS = {"aware": ("prefix", True, "off"), "round_robin": ("round_robin", True, "off"),
        "none": ("round_robin", False, "off"), "round_robin_fetch": ("round_robin", True, "always")}


def run_arm(arm: str, prompts: list[list[int]], concurrency: int, workers: int,
            load_weight: float | None = None, min_gain: int | None = None, prefill: dict | None = None) -> dict:
    """One stack with `workers` prefill workers set up as `arm` (then `prefill`'s settings
    of the prefill section); the replay's figures."""
    from serving import summary

    from lamina.ports import free_port
    from lamina.services.config import AttentionSection, GatewaySection, PrefillSection, StackConfig
    from lamina.services.launch.launcher import Stack

    routing, cached, fetch = ARMS[arm]
    section = PrefillSection(workers=workers, routing=routing, peer_fetch=fetch)
    if load_weight is not None:  # prefix routing's weight of queued tokens against matched ones
        section = dataclasses.replace(section, routing_load_weight=load_weight)
    if min_gain is not None:  # prefix routing's least gain of a prefix worth following
        section = dataclasses.replace(section, routing_min_gain_tokens=min_gain)
    if not cached:
        section = PrefillSection(workers=workers, routing=routing, peer_fetch=fetch, cache_device_bytes=0)
    section = dataclasses.replace(section, **(prefill or {}))
    config = StackConfig(prefill=section,
                         attention=AttentionSection(workers=1, kv_capacity_bytes=512 << 20),
                         gateway=GatewaySection(port=free_port()))
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
    fetched = sum(f["fetched_tokens"] for f in figures.values())
    by_tier = {tier: sum(f.get("hit_tokens_by_tier", {}).get(tier, 0) for f in figures.values())
               for tier in ("device", "host", "disk")}
    t = summary(ttft)
    return {"hit_ratio": hit_tokens / prompt_tokens, "computed_tokens": prompt_tokens - hit_tokens - fetched,
            "hit_tokens": hit_tokens, "fetched_tokens": fetched, "prompt_tokens": prompt_tokens,
            "hit_tokens_by_tier": by_tier, "prefetched_blocks": sum(f.get("prefetched_blocks", 0)
                                                                    for f in figures.values()),
            "ttft_p50_s": t["p50"], "ttft_p99_s": t["p99"], "seconds": seconds, "ttft_s": ttft,
            "per_worker": {n: {"prompt_tokens": f["prompt_tokens"], "hit_tokens": f["hit_tokens"],
                               "fetched_tokens": f["fetched_tokens"]} for n, f in figures.items()}}


def _workload_line(prompts: list[list[int]], sample: str, min_turns: int, offset: int, scale: int,
                   max_prompt: int, concurrency: int) -> str:
    what = (f"conversations with at least {min_turns} requests" if sample == "conversations"
            else f"requests {offset}..{offset + len(prompts) - 1}")
    total = sum(len(p) for p in prompts)
    return (f"Kimi trace, {len(prompts)} requests ({what}), lengths / {scale} (at most {max_prompt} tokens; "
            f"{total} prompt tokens, mean {total / len(prompts):.0f}), 1 output token, {concurrency} in flight")


def run_cluster(n: int, offset: int, scale: int, max_prompt: int, concurrency: int, workers: int = 2,
                sample: str = "conversations", min_turns: int = 6, load_weight: float | None = None,
                min_gain: int | None = None, arms: tuple[str, ...] = tuple(ARMS)) -> dict:
    """Prints the workload and each arm's results; returns them with their ratios."""
    prompts = load_prompts(n, offset, scale, max_prompt, sample, min_turns)
    block = 512 // scale
    total = sum(len(p) for p in prompts)
    ideal = ideal_hit_tokens(prompts, block)
    # The best ratio any router can reach against round robin while the caches hold
    # everything (as with the defaults here): one cache's computed tokens over round
    # robin's with one unbounded cache per worker.
    bound = (total - ideal) / (total - ideal_hit_tokens(prompts, block, workers))
    print(f"\n== cluster: {_workload_line(prompts, sample, min_turns, offset, scale, max_prompt, concurrency)}; "
          f"{workers} prefill workers, 1 attention worker, 1 model worker; ideal (one unbounded cache) hit ratio "
          f"{ideal / total:.4f}; with unbounded caches no router computes less than {bound:.3f}x round robin's "
          f"prefill tokens", flush=True)
    results = {}
    for arm in arms:
        r = run_arm(arm, prompts, concurrency, workers, load_weight, min_gain)
        del r["ttft_s"]  # its percentiles are kept
        results[arm] = r
        print(f"  {arm:17s} computed {r['computed_tokens']:6d} of {r['prompt_tokens']} prompt tokens, hit ratio "
              f"{r['hit_ratio']:.4f}, fetched {r['fetched_tokens']}, TTFT p50 {r['ttft_p50_s']:.2f} s "
              f"p99 {r['ttft_p99_s']:.2f} s, {r['seconds']:.1f} s; per worker {r['per_worker']}", flush=True)
    workload = {"trace": "kimi_conversation_trace", "sample": sample, "min_turns": min_turns,
                "offset": offset, "requests": len(prompts), "scale": scale, "max_prompt": max_prompt,
                "prompt_tokens": total, "concurrency": concurrency, "prefill_workers": workers,
                "routing_load_weight": load_weight, "routing_min_gain_tokens": min_gain,
                "ideal_hit_ratio": ideal / total, "best_computed_ratio_any_router": bound}
    if not {"aware", "round_robin", "none"} <= results.keys():
        return {"workload": workload, **results}  # some arms left out: no ratios
    aware, rr, none = results["aware"], results["round_robin"], results["none"]
    ratio = {"computed_tokens": aware["computed_tokens"] / rr["computed_tokens"],
             "ttft_p50": aware["ttft_p50_s"] / rr["ttft_p50_s"],
             "computed_tokens_vs_none": aware["computed_tokens"] / none["computed_tokens"]}
    print(f"  aware / round robin: computed tokens {ratio['computed_tokens']:.3f}x (target <= 0.6x), "
          f"TTFT p50 {ratio['ttft_p50']:.3f}x (target < 1); aware / none: computed tokens "
          f"{ratio['computed_tokens_vs_none']:.3f}x")
    return {"workload": workload, **results, "ratio": ratio,
            "targets_met": {"computed_0_6x": ratio["computed_tokens"] <= 0.6, "ttft_p50_lower": ratio["ttft_p50"] < 1}}


def run_prefetch(n: int, offset: int, scale: int, max_prompt: int, concurrency: int, workers: int = 2,
                 sample: str = "conversations", min_turns: int = 6, device_blocks: int = 96,
                 host_bytes: int = 512 << 20, rounds: int = 1) -> dict:
    """The prefetcher on against off (prefix routing), with device tiers of `device_blocks`
    cache blocks and host tiers of `host_bytes`; prints and returns each setting's figures
    and their ratio (on / off)."""
    from serving import summary

    from lamina.model.checkpoints import load_config

    prompts = load_prompts(n, offset, scale, max_prompt, sample, min_turns)
    block = 512 // scale
    total = sum(len(p) for p in prompts)
    block_bytes = block * load_config(None).kv_bytes_per_token()
    ideal = ideal_hit_tokens(prompts, block)
    tiers = {"cache_block_tokens": block, "cache_device_bytes": device_blocks * block_bytes,
             "cache_host_bytes": host_bytes}
    print(f"\n== cluster, prefetch on against off: "
          f"{_workload_line(prompts, sample, min_turns, offset, scale, max_prompt, concurrency)}; {workers} prefill "
          f"workers routed by prefix, each cache {device_blocks} blocks of {block} tokens on device and "
          f"{host_bytes / 2**20:.0f} MiB on host (about {host_bytes // block_bytes} blocks); "
          f"{rounds} round(s), alternating; ideal hit ratio {ideal / total:.4f}", flush=True)
    runs: dict[str, list[dict]] = {"prefetch": [], "no_prefetch": []}
    for i in range(rounds):
        order = ("prefetch", "no_prefetch") if i % 2 == 0 else ("no_prefetch", "prefetch")
        for name in order:
            r = run_arm("aware", prompts, concurrency, workers, prefill={**tiers, "prefetch": name == "prefetch"})
            runs[name].append(r)
            print(f"  round {i + 1} {name:11s} TTFT p50 {r['ttft_p50_s']:.3f} s p99 {r['ttft_p99_s']:.3f} s, "
                  f"hits by tier {r['hit_tokens_by_tier']}, blocks prefetched {r['prefetched_blocks']}, "
                  f"computed {r['computed_tokens']} of {r['prompt_tokens']}, {r['seconds']:.1f} s", flush=True)
    results: dict = {}
    for name, rs in runs.items():
        t = summary([x for r in rs for x in r["ttft_s"]])
        results[name] = {"ttft_p50_s": t["p50"], "ttft_p99_s": t["p99"], "ttft_mean_s": t["mean"],
                         "hit_tokens_by_tier": {k: sum(r["hit_tokens_by_tier"][k] for r in rs)
                                                for k in ("device", "host", "disk")},
                         "prefetched_blocks": sum(r["prefetched_blocks"] for r in rs),
                         "computed_tokens": [r["computed_tokens"] for r in rs],
                         "seconds": [round(r["seconds"], 1) for r in rs]}
    on, off = results["prefetch"], results["no_prefetch"]
    ratio = {"ttft_p50": on["ttft_p50_s"] / off["ttft_p50_s"], "ttft_p99": on["ttft_p99_s"] / off["ttft_p99_s"]}
    for name, r in results.items():
        print(f"  {name:11s} all rounds: TTFT p50 {r['ttft_p50_s']:.3f} s p99 {r['ttft_p99_s']:.3f} s, "
              f"hits by tier {r['hit_tokens_by_tier']}, blocks prefetched {r['prefetched_blocks']}")
    print(f"  prefetch / no prefetch: TTFT p50 {ratio['ttft_p50']:.3f}x, p99 {ratio['ttft_p99']:.3f}x")
    workload = {"trace": "kimi_conversation_trace", "sample": sample, "min_turns": min_turns, "offset": offset,
                "requests": len(prompts), "scale": scale, "max_prompt": max_prompt, "prompt_tokens": total,
                "concurrency": concurrency, "prefill_workers": workers, "routing": "prefix",
                "device_blocks": device_blocks, "host_bytes": host_bytes, "rounds": rounds,
                "ideal_hit_ratio": ideal / total}
    return {"workload": workload, **results, "ratio": ratio}
