"""Prefix-cache benchmark: TTFT by tier with the real model, and a Kimi trace replay.

Part 1 (SmolLM2-135M-Instruct, CPU): time to first token for a prompt of
--prompt-tokens tokens whose first --prefix-tokens are a shared prefix, when the prefix
is not cached, cached on device, on host, and on disk. TTFT = prefix-cache acquire
(transfer up to device) + prefill of the uncached suffix + picking the first token.

Part 2 (Kimi conversation trace, ../shared/traces): replays the first --trace-requests
requests through a PrefixCache. Scaled to 2 cores: every length is divided by 16 (the
trace's 512-token blocks become 32-token blocks; prompt lengths // 16, at least 1), and
the payload of a block is one layer of the real model's KV ([1, 2, 32, 3, 64] float32,
48 KiB) instead of 30 layers, so the working set fits this machine's disk and time;
hit ratios depend on block counts, not payload sizes. Block tokens are derived from the
trace's hash ids, so equal ids give equal tokens. No model runs in part 2: "prefill
tokens saved" counts the prompt tokens a hit let prefill skip.

Cluster mode (--cluster, bench/prefix_cache_cluster.py): the Kimi trace's conversations
through `lamina up`'s stack with two prefill workers, routed by prefix, round robin, round
robin with no prefix cache, and round robin fetching prefixes from the peer; prefill
tokens computed, hit ratio, TTFT p50/p99 of each, and their ratios. With --cluster-prefetch
it compares instead the prefill workers' prefetcher on and off (prefix routing, device tiers
of --cluster-device-blocks blocks, host tiers of --cluster-host-bytes; --cluster-rounds
alternating rounds): TTFT p50/p99 of each, their ratio, and hits by tier. It runs alone
(parts 1 and 2 are skipped) and stops every process it started on exit, Ctrl-C or SIGTERM.

The last line printed is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from lamina.kvstore.block_hash import ROOT_HASH
from lamina.kvstore.prefetch import Prefetcher
from lamina.kvstore.prefix_cache import PrefixCache, PrefixCacheConfig
from lamina.kvstore.prefix_index import PrefixIndex
from lamina.kvstore.tiers import Tier

TRACES = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces"
SCALE = 16
TRACE_BLOCK = 512 // SCALE


# ---------------- part 1: TTFT with the real model ----------------

def ttft_by_tier(prompt_tokens: int, prefix_tokens: int, block: int, repeats: int) -> dict:
    from lamina.engine.prefix_prefill import prefill
    from lamina.model.loader import load_model

    loaded = load_model()
    model, cfg = loaded.model, loaded.config
    torch.manual_seed(0)
    vocab = cfg.vocab_size
    shared = torch.randint(100, vocab, (prefix_tokens,)).tolist()
    prompt = shared + torch.randint(100, vocab, (prompt_tokens - prefix_tokens,)).tolist()
    other = shared + torch.randint(100, vocab, (prompt_tokens - prefix_tokens,)).tolist()
    # the cache is filled by an earlier request that shared the prefix
    first = prefill(model, other)
    block_bytes = cfg.num_layers * 2 * block * cfg.num_kv_heads * cfg.head_dim * 4
    nb = prefix_tokens // block
    filler = [7 + i % 1000 for i in range(nb * block)]

    def measure(tier: str | None) -> tuple[float, int]:
        tmp = tempfile.mkdtemp(prefix="lamina-bench-kv-")
        try:
            sizes = {None: (nb, 0, 0), "device": (nb, 0, 0), "host": (nb, 2 * nb, 0),
                     "disk": (nb, 0, 4 * nb)}[tier]
            cache = PrefixCache(PrefixCacheConfig(
                block_size=block, device_bytes=sizes[0] * block_bytes,
                host_bytes=sizes[1] * block_bytes, disk_bytes=sizes[2] * block_bytes,
                disk_dir=tmp))
            if tier is not None:
                cache.insert(other[:prefix_tokens], first.kv)
                if tier != "device":
                    cache.insert(filler, first.kv)  # pushes the prefix down one tier
                assert cache.tier_distance(prompt) == Tier[tier.upper()]
            start = time.perf_counter()
            with cache.acquire(prompt) as h:
                out = prefill(model, prompt, h.kv)
            token = int(out.logits.argmax())
            elapsed = time.perf_counter() - start
            return elapsed, token if tier is None else (h.num_tokens and token)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    results, tokens = {}, {}
    for name in ("miss", "device", "host", "disk"):
        runs = [measure(None if name == "miss" else name) for _ in range(repeats)]
        results[name] = min(t for t, _ in runs)
        tokens[name] = runs[0][1]
    assert len(set(tokens.values())) == 1, f"first tokens differ by tier: {tokens}"
    return results


# ---------------- part 2: trace replay ----------------

def load_trace(n: int) -> list[list[int]]:
    prompts = []
    with open(TRACES / "kimi_conversation_trace.jsonl") as f:
        for line in f:
            r = json.loads(line)
            length = max(1, r["input_length"] // SCALE)
            toks: list[int] = []
            for h in r["hash_ids"]:
                # 32 distinct token ids per hash id; equal ids -> equal tokens
                toks.extend((h * 1_000_003 + i * 7_919) % 49_000 + 100
                            for i in range(TRACE_BLOCK))
            prompts.append(toks[:length])
            if len(prompts) == n:
                break
    return prompts


def ideal(prompts: list[list[int]]) -> tuple[float, int]:
    """Hit ratio of an unbounded cache, and the number of distinct blocks."""
    index = PrefixIndex(TRACE_BLOCK)
    hit = total = 0
    for p in prompts:
        hit += index.match(p).num_tokens
        total += len(p)
        parent = ROOT_HASH
        for i in range(0, len(p) - TRACE_BLOCK + 1, TRACE_BLOCK):
            parent = index.insert(parent, p[i:i + TRACE_BLOCK])
    return hit / total, len(index)


def replay(prompts, device_blocks, host_blocks, disk_blocks, policy, lookahead) -> dict:
    block_bytes = 1 * 2 * TRACE_BLOCK * 3 * 64 * 4
    tmp = tempfile.mkdtemp(prefix="lamina-bench-trace-")
    try:
        cache = PrefixCache(PrefixCacheConfig(
            block_size=TRACE_BLOCK, device_bytes=device_blocks * block_bytes,
            host_bytes=host_bytes if (host_bytes := host_blocks * block_bytes) else 0,
            # a disk file is the payload plus a small header: budget 2 KiB per block
            disk_bytes=disk_blocks * (block_bytes + 2048), disk_dir=tmp, eviction=policy))
        prefetcher = Prefetcher(cache, lookahead) if lookahead else None
        max_len = max(len(p) for p in prompts)
        kv = torch.randn(1, 2, max_len, 3, 64)  # [L, 2, T, H, D]; content irrelevant
        hit = total = 0
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            if prefetcher is not None:
                prefetcher.run([(j, prompts[j]) for j in range(i, min(i + lookahead, len(prompts)))])
            with cache.acquire(p) as h:
                hit += h.num_tokens
            if prefetcher is not None:
                prefetcher.release(i)  # prompt i has taken its prefix: its blocks may move again
            total += len(p)
            cache.insert(p, kv)
        s = cache.stats
        return {"hit_ratio": hit / total, "prefill_tokens_saved": hit, "prompt_tokens": total,
                "hit_tokens_by_tier": dict(s.hit_tokens_by_tier),
                "promotions": dict(s.num_promotions), "demotions": dict(s.num_demotions),
                "dropped": s.num_dropped, "seconds": round(time.perf_counter() - start, 2)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--prefix-tokens", type=int, default=1536)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--trace-requests", type=int, default=300)
    ap.add_argument("--skip-model", action="store_true", help="trace replay only")
    ap.add_argument("--cluster", action="store_true",
                    help="only the cluster comparison: 2 prefill workers, prefix routing against round robin, "
                         "no prefix cache, and round robin with peer fetching")
    ap.add_argument("--cluster-requests", type=int, default=100, help="about this many requests")
    ap.add_argument("--cluster-sample", choices=("conversations", "window"), default="conversations",
                    help="whole conversations of the trace, or a window of consecutive requests")
    ap.add_argument("--cluster-min-turns", type=int, default=6, help="conversations with at least this many requests")
    ap.add_argument("--cluster-offset", type=int, default=0, help="first trace request of a window")
    ap.add_argument("--cluster-scale", type=int, default=32, help="divide every trace length by this")
    ap.add_argument("--cluster-max-prompt", type=int, default=2048)
    ap.add_argument("--cluster-concurrency", type=int, default=4)
    ap.add_argument("--cluster-load-weight", type=float, default=None,
                    help="prefill.routing_load_weight of the stacks (default: the configuration's, 0); "
                         "1 weighs queued tokens 1:1 against held ones")
    ap.add_argument("--cluster-min-gain", type=int, default=None,
                    help="prefill.routing_min_gain_tokens of the stacks (default: the configuration's, 32)")
    ap.add_argument("--cluster-arms", default=",".join(("aware", "round_robin", "none", "round_robin_fetch")),
                    help="comma-separated arms to run (ratios need aware, round_robin and none)")
    ap.add_argument("--cluster-prefetch", action="store_true",
                    help="cluster mode, but instead of the routing arms: prefix routing with the prefill workers' "
                         "prefetcher on against off, device tiers of --cluster-device-blocks blocks")
    ap.add_argument("--cluster-device-blocks", type=int, default=96,
                    help="--cluster-prefetch: each prefill worker's device tier, in cache blocks; at least the "
                         "longest prompt's (a prefill takes no more of its prefix than the device holds)")
    ap.add_argument("--cluster-host-bytes", type=int, default=512 << 20,
                    help="--cluster-prefetch: each prefill worker's host tier (bytes)")
    ap.add_argument("--cluster-rounds", type=int, default=1,
                    help="--cluster-prefetch: rounds of both settings, alternating which runs first")
    args = ap.parse_args()
    from prefix_cache_cluster import ARMS
    unknown = set(args.cluster_arms.split(",")) - ARMS.keys()
    if unknown:
        ap.error(f"--cluster-arms: unknown {', '.join(sorted(unknown))}; expected some of {', '.join(ARMS)}")
    if args.cluster_rounds < 1 or args.cluster_device_blocks < 1:
        ap.error("--cluster-rounds and --cluster-device-blocks must be at least 1")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out: dict = {}
    if args.cluster or args.cluster_prefetch:
        import os
        import platform
        import signal
        import sys

        from engine_throughput import cpu_model
        from prefix_cache_cluster import run_cluster, run_prefetch

        signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # unwinds to the stack's stop()
        load = os.getloadavg()
        print(f"machine: {cpu_model()}, {os.cpu_count()} cores, {platform.python_implementation()} "
              f"{platform.python_version()}, torch {torch.__version__}, load average {load[0]:.1f}")
        if args.cluster_prefetch:
            out["cluster_prefetch"] = run_prefetch(
                args.cluster_requests, args.cluster_offset, args.cluster_scale, args.cluster_max_prompt,
                args.cluster_concurrency, sample=args.cluster_sample, min_turns=args.cluster_min_turns,
                device_blocks=args.cluster_device_blocks, host_bytes=args.cluster_host_bytes,
                rounds=args.cluster_rounds)
        else:
            out["cluster"] = run_cluster(args.cluster_requests, args.cluster_offset, args.cluster_scale,
                                         args.cluster_max_prompt, args.cluster_concurrency,
                                         sample=args.cluster_sample, min_turns=args.cluster_min_turns,
                                         load_weight=args.cluster_load_weight, min_gain=args.cluster_min_gain,
                                         arms=tuple(args.cluster_arms.split(",")))
        out["machine"] = {"cpu": cpu_model(), "cores": os.cpu_count(), "load_before": load,
                          "load_after": os.getloadavg()}
        print(json.dumps(out))
        return

    if not args.skip_model:
        print(f"== TTFT, SmolLM2-135M-Instruct on CPU ({torch.get_num_threads()} threads): "
              f"{args.prompt_tokens}-token prompt, {args.prefix_tokens}-token shared prefix, "
              f"blocks of {args.block_size}, best of {args.repeats}")
        ttft = ttft_by_tier(args.prompt_tokens, args.prefix_tokens, args.block_size,
                            args.repeats)
        for k, v in ttft.items():
            print(f"  {k:7s} {v:7.3f} s   speedup vs miss {ttft['miss'] / v:5.2f}x")
        print("  (the disk hit reads files just written: they are likely in the page cache)")
        out["ttft_s"] = {k: round(v, 4) for k, v in ttft.items()}
        out["ttft_speedup"] = {k: round(ttft["miss"] / ttft[k], 2)
                               for k in ("device", "host", "disk")}

    prompts = load_trace(args.trace_requests)
    ideal_ratio, num_blocks = ideal(prompts)
    ws = num_blocks
    dev, host = max(1, ws // 100), max(1, ws // 50)
    print(f"\n== Kimi trace replay: first {len(prompts)} requests, lengths / {SCALE}, "
          f"{TRACE_BLOCK}-token blocks, {num_blocks} distinct blocks (working set); "
          f"ideal (unbounded) hit ratio {ideal_ratio:.4f}")
    print(f"  tiers: device {dev} blocks (1%), host {host} blocks (2%), disk holds all")
    first = replay(prompts, dev, host, ws + 16, "lru", 0)
    first["ideal_hit_ratio"] = ideal_ratio
    first["fraction_of_ideal"] = first["hit_ratio"] / ideal_ratio
    first["working_set_blocks"] = ws
    print(f"  hit ratio {first['hit_ratio']:.4f} = {first['fraction_of_ideal']:.1%} of ideal; "
          f"hits by tier {first['hit_tokens_by_tier']}; "
          f"prefill tokens saved {first['prefill_tokens_saved']} of {first['prompt_tokens']}")
    out["trace"] = first

    disk = ws // 4
    print(f"\n== bounded disk: {disk} blocks (25% of the working set); lookahead 8")
    bounded = {}
    for policy in ("lru", "fifo", "random"):
        bounded[policy] = {}
        for name, la in (("no_prefetch", 0), ("prefetch", 8)):
            r = replay(prompts, dev, host, disk, policy, la)
            bounded[policy][name] = r
            print(f"  {policy:6s} {name:11s} hit ratio {r['hit_ratio']:.4f} "
                  f"({r['hit_ratio'] / ideal_ratio:.1%} of ideal) by tier "
                  f"{r['hit_tokens_by_tier']} [{r['seconds']} s]")
    out["trace_bounded_disk"] = bounded
    targets = {}
    if "ttft_s" in out:
        targets["host_4x"] = out["ttft_speedup"]["host"] >= 4
        targets["disk_2x"] = out["ttft_speedup"]["disk"] >= 2
    targets["trace_90pct_of_ideal"] = first["fraction_of_ideal"] >= 0.9
    out["targets_met"] = targets
    print(f"\ntargets: {targets}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
