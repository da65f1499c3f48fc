"""What 4-bit KV on the attention workers (attention.kv_quant: q4) costs in quality, and
what it saves, beside float32 KV.

Prompts: the eight held-out prompts of tests/model/test_reference.py (four completions,
four chats) and --long longer ones: natural text (this repository's docs/*.md as of
commit TEXT_COMMIT, so that the prompts stay the same as the docs change) cut to
prompt lengths drawn from the Azure conversation trace (../shared/traces/azure_conv_2023.csv,
divided by --scale and capped at --max-prompt: two CPU cores).

Each prompt's forward runs once with dense float attention, as the prefill worker runs
it, and its K, V are stored into an attention core (lamina.services.attention.attention_core, the
attention workers' code and kernel) as STORE_KV frames would store them: quantized on
arrival under q4. Then every prompt decodes together, one token a step, with each
layer's attention done by the core, in three runs of --new-tokens steps:
  float32 greedy   float32 KV: the reference tokens and logits
  q4 forced        q4 KV, fed the reference tokens: logit error at the same positions
  q4 greedy        q4 KV on its own: tokens until the first divergence, identical continuations
A continuation ends at the reference's first end-of-sequence token (or --new-tokens).

Where the error comes from: the longest prompt (its first --ablation-tokens tokens) runs
its forward with dense attention over K and/or V passed through 4-bit rows, with groups
of 16, 32 (the attention workers') and 64 values, every position's logits against the
float forward; and K's largest magnitude beside the median over channels of each
channel's largest.

Attention time per layer is the CPU time of this thread (the kernel runs in it; other
processes on a shared host do not count) in the core's attend calls (appending the new K, V,
quantized under q4, and the attention) during the greedy runs, per step and layer, and
separately for --batch sequences of --context tokens (synthetic KV). KV bytes per token
count every layer's K and V of the model's KV heads.

Prints a table, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lamina.model.attention import attention_with_lse
from lamina.model.kv_attention import NATIVE
from lamina.model.kv_quant import Q4Rows
from lamina.services.attention.attention_core import AttentionCore
from lamina.services.wire import StoreKV

REPO = Path(__file__).resolve().parents[1]

TRACE = REPO.parent / "shared" / "traces" / "azure_conv_2023.csv"
TEXT_COMMIT = "3a41b2ad938b96bc1e52c6069fbd51a4b402206c"  # docs of the commit before quantized KV


def held_out_prompts() -> tuple[list[str], list[str]]:
    """tests/model/test_reference.py's completion and chat prompts (read from there, so
    that the two stay the same)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("test_reference", REPO / "tests" / "model" / "test_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.COMPLETION_PROMPTS, module.CHAT_PROMPTS


def docs_text() -> list[str]:
    """docs/*.md of this repository at TEXT_COMMIT."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True).stdout

    names = git("ls-tree", "--name-only", TEXT_COMMIT, "docs/").split()
    return [git("show", f"{TEXT_COMMIT}:{name}") for name in sorted(names) if name.endswith(".md")]


def make_prompts(tok, long: int, scale: int, max_prompt: int, seed: int) -> tuple[list[list[int]], list[str]]:
    completions, chats = held_out_prompts()
    prompts = [tok.encode(p) for p in completions]
    prompts += [tok.encode_chat([{"role": "user", "content": p}]) for p in chats]
    names = [f"held-out {i}" for i in range(len(prompts))]
    if long:
        with open(TRACE) as f:
            lengths = [int(r["ContextTokens"]) for r in csv.DictReader(f)]
        rng = random.Random(seed)
        text = tok.encode("\n\n".join(docs_text()))
        for i in range(long):
            n = min(max_prompt, max(16, rng.choice(lengths) // scale), len(text))
            start = rng.randrange(0, len(text) - n + 1)
            prompts.append(text[start : start + n])
            names.append(f"long {i}")
    return prompts, names


@dataclass
class PromptKV:
    """A prompt's K, V per layer ([n, Hkv, D] each) and the logits of its last position."""

    kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    logits: torch.Tensor | None = None


class _Prefill:
    """Dense causal attention over the prompt (the prefill worker's), keeping its K, V."""

    def __init__(self, record: PromptKV) -> None:
        self.record = record

    def attend(self, layer_id, q, k, v):
        self.record.kv.append((k.contiguous().clone(), v.contiguous().clone()))
        return attention_with_lse(q, k, v)[0]


class _Decode:
    """Each layer's attention by the attention core, timed."""

    def __init__(self, core: AttentionCore, seqs: list[tuple[str, int]]) -> None:
        self.core, self.seqs, self.seconds, self.calls = core, seqs, 0.0, 0

    def attend(self, layer_id, q, k, v):
        t = time.thread_time()
        out, _ = self.core.attend(layer_id, self.seqs, q.contiguous(), k.contiguous(), v.contiguous())
        self.seconds += time.thread_time() - t
        self.calls += 1
        return out


def prefill(loaded, prompts: list[list[int]]) -> list[PromptKV]:
    records = []
    with torch.no_grad():
        for ids in prompts:
            rec = PromptKV()
            n = len(ids)
            rec.logits = loaded.model(torch.tensor(ids), torch.arange(n), torch.tensor([n - 1]), _Prefill(rec))[0]
            records.append(rec)
    return records


def new_core(loaded, records: list[PromptKV], kv_quant: str, new_tokens: int) -> AttentionCore:
    cfg = loaded.config
    tokens = sum(r.kv[0][0].shape[0] + new_tokens for r in records)
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # float32: enough for either
    core = AttentionCore(cfg, (tokens + 64 * len(records)) * per_token, cfg.num_kv_heads, kv_quant=kv_quant)
    for i, rec in enumerate(records):
        for layer, (k, v) in enumerate(rec.kv):
            core.store(StoreKV(str(i), layer, cfg.num_layers, k, v))
    return core


def decode(loaded, records: list[PromptKV], prompts: list[list[int]], kv_quant: str, steps: int,
           forced: list[list[int]] | None = None) -> dict:
    """Greedy (or forced) decoding of every prompt together. Returns tokens [B][steps],
    logits [steps, B, V] of each step's input position, and attention time per layer call."""
    core = new_core(loaded, records, kv_quant, steps)
    b = len(records)
    ctx = _Decode(core, [(str(i), 1) for i in range(b)])
    logits = torch.stack([r.logits for r in records])  # [B, V]: the prefill's, the same for every run
    tokens: list[list[int]] = [[] for _ in range(b)]
    all_logits = []
    positions = torch.tensor([len(p) for p in prompts])
    with torch.no_grad():
        for step in range(steps):
            all_logits.append(logits)
            nxt = logits.argmax(-1) if forced is None else torch.tensor([f[step] for f in forced])
            for i in range(b):
                tokens[i].append(int(nxt[i]))
            if step == steps - 1:
                break
            logits = loaded.model(nxt, positions + step, torch.arange(b), ctx)
    return {"tokens": tokens, "logits": torch.stack(all_logits), "attend_s_per_layer": ctx.seconds / max(1, ctx.calls),
            "bytes_per_token": core.slabs.config.bytes_per_token}


def end(tokens: list[int], eos: tuple[int, ...]) -> int:
    """Length of a continuation up to and including its first end-of-sequence token."""
    for i, t in enumerate(tokens):
        if t in eos:
            return i + 1
    return len(tokens)


ABLATIONS = [("K and V, groups of 32", True, True, 32), ("K only, groups of 32", True, False, 32),
             ("V only, groups of 32", False, True, 32), ("K and V, groups of 16", True, True, 16),
             ("K and V, groups of 64", True, True, 64)]


class _RoundTrip:
    """Dense causal attention over K and/or V passed through 4-bit rows; records K."""

    def __init__(self, rows: Q4Rows | None, on_k: bool, on_v: bool) -> None:
        self.rows, self.on_k, self.on_v, self.keys = rows, on_k, on_v, []

    def attend(self, layer_id, q, k, v):
        self.keys.append(k)
        if self.rows is not None:
            k = self.rows.dequantize(self.rows.quantize(k.contiguous())) if self.on_k else k
            v = self.rows.dequantize(self.rows.quantize(v.contiguous())) if self.on_v else v
        return attention_with_lse(q, k, v)[0]


def ablation(loaded, ids: list[int]) -> dict:
    t = torch.tensor(ids)
    n = len(ids)

    def forward(ctx):
        with torch.no_grad():
            return loaded.model(t, torch.arange(n), torch.arange(n), ctx)  # [n, V]

    plain = _RoundTrip(None, False, False)
    ref = forward(plain)
    keys = torch.stack(plain.keys)  # [L, n, Hkv, D]
    channel_max = keys.abs().amax(1)  # [L, Hkv, D]
    out = {"tokens": n, "k_max": float(channel_max.max()), "k_channel_max_median": float(channel_max.median())}
    for name, on_k, on_v, group in ABLATIONS:
        logits = forward(_RoundTrip(Q4Rows(loaded.config.head_dim, group), on_k, on_v))
        diff = (logits - ref).abs()
        out[name] = {"max": float(diff.max()), "mean": float(diff.mean()),
                     "top1": float((logits.argmax(-1) == ref.argmax(-1)).float().mean())}
    return out


def synthetic_attend(cfg, kv_quant: str, batch: int, context: int, repeats: int) -> float:
    """CPU seconds per layer call of AttentionCore.attend for `batch` sequences of `context`
    tokens, one new token each (random K, V)."""
    torch.manual_seed(0)
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    core = AttentionCore(cfg, batch * (context + 64 + repeats) * per_token, cfg.num_kv_heads, kv_quant=kv_quant)
    hkv, d = cfg.num_kv_heads, cfg.head_dim
    for i in range(batch):
        for layer in range(cfg.num_layers):
            core.store(StoreKV(str(i), layer, cfg.num_layers,
                               torch.randn(context, hkv, d), torch.randn(context, hkv, d)))
    seqs = [(str(i), 1) for i in range(batch)]
    times = []
    for _ in range(repeats):
        q, k, v = torch.randn(batch, cfg.num_heads, d), torch.randn(batch, hkv, d), torch.randn(batch, hkv, d)
        t = time.thread_time()
        for layer in range(cfg.num_layers):
            core.attend(layer, seqs, q, k, v)
        times.append((time.thread_time() - t) / cfg.num_layers)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--long", type=int, default=4, help="long prompts from the trace's lengths (default 4)")
    ap.add_argument("--scale", type=int, default=2, help="divide the trace's prompt lengths by this (default 2)")
    ap.add_argument("--max-prompt", type=int, default=1024, help="cap on a long prompt's tokens (default 1024)")
    ap.add_argument("--new-tokens", type=int, default=48, help="decode steps per run (default 48)")
    ap.add_argument("--batch", type=int, default=16, help="sequences of the synthetic attention timing")
    ap.add_argument("--context", type=int, default=1024, help="tokens per sequence of the synthetic timing")
    ap.add_argument("--ablation-tokens", type=int, default=300, help="tokens of the ablation's prompt")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from lamina.model.loader import load_model

    loaded = load_model()
    tok, cfg = loaded.tokenizer, loaded.config
    prompts, names = make_prompts(tok, args.long, args.scale, args.max_prompt, args.seed)
    print(f"model {loaded.source.name} (weights {loaded.weights}), {len(prompts)} prompts of "
          f"{min(map(len, prompts))}..{max(map(len, prompts))} tokens ({args.long} long: Azure conv lengths / "
          f"{args.scale}, at most {args.max_prompt}), {args.new_tokens} new tokens, kernel "
          f"{'native' if NATIVE is not None else 'torch'}, {args.threads} thread(s)", file=sys.stderr)
    t0 = time.perf_counter()
    records = prefill(loaded, prompts)
    ref = decode(loaded, records, prompts, "none", args.new_tokens)
    forced = decode(loaded, records, prompts, "q4", args.new_tokens, forced=ref["tokens"])
    free = decode(loaded, records, prompts, "q4", args.new_tokens)
    eos = tok.eos_token_ids

    rows, max_err, sum_err, count, top1, positions = [], 0.0, 0.0, 0, 0, 0
    agree, identical = [], 0
    for i, name in enumerate(names):
        n = end(ref["tokens"][i], eos)
        diff = (forced["logits"][:n, i] - ref["logits"][:n, i]).abs()  # [n, V]
        same_top1 = int((forced["logits"][:n, i].argmax(-1) == ref["logits"][:n, i].argmax(-1)).sum())
        first = next((j for j in range(n) if free["tokens"][i][j] != ref["tokens"][i][j]), n)
        rows.append((name, len(prompts[i]), n, float(diff.max()), float(diff.mean()), same_top1, first))
        max_err, sum_err, count = max(max_err, float(diff.max())), sum_err + float(diff.sum()), count + diff.numel()
        top1, positions = top1 + same_top1, positions + n
        agree.append(first)
        identical += first == n

    print(f"{'prompt':<12} {'tokens':>6} {'compared':>8} {'max |dlogit|':>12} {'mean |dlogit|':>13} "
          f"{'top-1 same':>10} {'q4 greedy = float32 for':>24}")
    for name, plen, n, mx, mean, same, first in rows:
        print(f"{name:<12} {plen:>6} {n:>8} {mx:>12.4f} {mean:>13.5f} {same:>6}/{n:<3} "
              f"{(str(first) + ' tokens' + (' (all)' if first == n else '')):>24}")
    abl = ablation(loaded, max(prompts, key=len)[: args.ablation_tokens])
    print(f"\nwhere the error comes from ({abl['tokens']} tokens, dense attention, every position):")
    for name, *_ in ABLATIONS:
        a = abl[name]
        print(f"  {name:<24} max |dlogit| {a['max']:8.4f}  mean {a['mean']:.5f}  top-1 same {a['top1']:.3f}")
    print(f"  K: largest magnitude {abl['k_max']:.2f}; median over channels of a channel's largest "
          f"{abl['k_channel_max_median']:.2f}")
    synth = {q: synthetic_attend(cfg, q, args.batch, args.context, 5) for q in ("none", "q4")}
    print()
    print(f"{'':<36} {'float32 KV':>12} {'q4 KV':>12}")
    print(f"{'KV bytes per token (all layers)':<36} {ref['bytes_per_token']:>12} {free['bytes_per_token']:>12}")
    print(f"{'attend CPU ms per layer, decode above':<36} {ref['attend_s_per_layer'] * 1e3:>12.3f} "
          f"{free['attend_s_per_layer'] * 1e3:>12.3f}")
    print(f"{f'attend CPU ms/layer, {args.batch} x {args.context} tok':<36} {synth['none'] * 1e3:>12.3f} "
          f"{synth['q4'] * 1e3:>12.3f}")
    greedy_same = identical == len(names)
    print(f"\nlogit error (q4 forced on the float32 tokens): max {max_err:.4f}, mean {sum_err / count:.5f}; "
          f"top-1 equal at {top1}/{positions} positions; greedy: {identical}/{len(names)} continuations identical, "
          f"mean {statistics.mean(agree):.1f} tokens before the first divergence "
          f"({'keeps' if greedy_same else 'does not keep'} greedy outputs); {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)
    print(json.dumps({
        "prompts": len(names), "new_tokens": args.new_tokens, "kernel": "native" if NATIVE is not None else "torch",
        "max_logit_error": round(max_err, 5), "mean_logit_error": round(sum_err / count, 6),
        "top1_agreement": round(top1 / positions, 4),
        "identical_continuations": identical, "continuations": len(names),
        "tokens_before_divergence": [r[6] for r in rows], "compared_tokens": [r[2] for r in rows],
        "keeps_greedy": greedy_same,
        "kv_bytes_per_token": {"none": ref["bytes_per_token"], "q4": free["bytes_per_token"]},
        "attend_ms_per_layer_decode": {"none": round(ref["attend_s_per_layer"] * 1e3, 4),
                                       "q4": round(free["attend_s_per_layer"] * 1e3, 4)},
        "attend_ms_per_layer_synthetic": {"batch": args.batch, "context": args.context,
                                          "none": round(synth["none"] * 1e3, 4), "q4": round(synth["q4"] * 1e3, 4)},
        "ablation": abl,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
