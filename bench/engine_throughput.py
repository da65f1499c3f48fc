"""Engine throughput: the local Lamina engine against transformers `generate`, same requests.

Workload: --requests requests sampled (without replacement, random.Random(--seed)) from the
Azure conversation trace (../shared/traces/azure_conv_2023.csv). Scaled to 2 CPU cores:
every length is divided by --scale (16), kept at least 1, prompts capped at --max-prompt
(256) and outputs at --max-output (32). Prompt tokens are random ids (seeded) of that length.
Output length is forced on both sides: the engine runs greedy with
SamplingParams(ignore_eos=True, max_tokens=out_len); transformers runs greedy with
min_new_tokens = max_new_tokens.

Lamina: every request is submitted at once to `lamina.engine.Engine` (continuous
batching, token-major batches without padding, the split model), run to completion.

transformers `generate`, in two forms: every request in one batch, as the engine gets
them ("same batch"), and in batches of the size among --hf-batches (default 4,8,16,32)
that ran fastest ("best batch": each size run once before the timed rounds, the one with
the least CPU time then timed with the others; CPU time, since on a shared machine one
run's wall time can be another process's). A batch is left-padded with an attention
mask to its longest prompt and decodes max_new_tokens = min_new_tokens = its largest
out_len; only the tokens each request asked for count. Requests are put in batches in
order of output length (so a batch decodes few steps past its requests' ends; the same
batch holds every request whatever the order).

The engine runs once per --weights choice (`load_model(weights=...)`: float32, q8_0, q4,
as_file; default float32 and as_file, side by side). --repeat rounds each run every
contender once: each engine choice, transformers same batch, transformers best batch, in
that order and reversed in every other round, so that load on the shared machine hits
them alike; figures are medians over the rounds, and the ratios (engine over
transformers, by wall time and by CPU time) are of the medians. transformers loads the
float32 weights from the cache directory (`LoadedModel.weights_dir`, a Hugging Face
layout with the GGUF's values dequantized, which is what `as_file` computes with too). A
short warm-up runs on both before timing; engine start-up (the split) is reported apart.
Exactness: the requests whose tokens equal transformers' (each form's first round).

Decode step: the engine's steps in which every sequence decodes one token (no prefill),
against the memory-bandwidth bound: bytes read per step (every weight the step reads, in
the form it is stored: packed bytes for packed weights, the embedding table only where it
is the LM head's; plus the KV of every sequence in the batch) / copy bandwidth (a 256 MiB
tensor copy, read + write bytes).

--decode-batches adds pure-decode steps at fixed batch sizes (40-token random prompts,
every weights choice in turn, CPU time).

Prints the runs, a table of the contenders' medians, and last one JSON object with every
number (the top-level engine figures are the first --weights choice's; "weights" holds
each choice's).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

# What `lamina profile` measures too: the copy bandwidth and the engine's pure-decode step.
from lamina.planner.measure.engine_step import decode_step_cpu
from lamina.planner.measure.kernels import copy_bandwidth

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"


def load_workload(n: int, seed: int, scale: int, max_prompt: int, max_output: int) -> list[tuple[int, int]]:
    with open(TRACES / "azure_conv_2023.csv") as f:
        rows = [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)]
    picked = random.Random(seed).sample(rows, n)
    return [(min(max_prompt, max(1, p // scale)), min(max_output, max(1, o // scale))) for p, o in picked]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def weight_bytes_read(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: every linear's weight (packed or not) and the
    norms, each tensor once; an embedding gathers one row per token and is left out unless
    it is the LM head's table (then the head counts it)."""
    from lamina.model.llama import RMSNorm
    from lamina.model.quant import QuantLinear

    seen: dict[int, int] = {}
    for m in model.modules():
        if isinstance(m, QuantLinear):
            tensors = list(m.buffers(recurse=False))
        elif isinstance(m, (torch.nn.Linear, RMSNorm)):
            tensors = [t for t in (m.weight, getattr(m, "bias", None)) if t is not None]
        else:
            continue
        for t in tensors:
            seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def run_lamina(loaded, prompts: list[list[int]], outs: list[int]) -> dict:
    from lamina.engine import Engine, SamplingParams

    t = time.perf_counter()
    engine = Engine(loaded)
    start_s = time.perf_counter() - t
    engine.generate([prompts[0][:8]], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4))  # warm-up

    lengths: dict[str, int] = {}  # tokens in each live sequence's KV after the coming step
    tokens: dict[str, list[int]] = {}
    order = []
    for p, o in zip(prompts, outs):
        sid = engine.add_request(p, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=o))
        lengths[sid] = len(p)
        order.append(sid)
    decode_steps: list[tuple[float, float, int, int]] = []  # (wall s, CPU s, batch size, KV tokens read)
    t0, c0 = time.perf_counter(), time.process_time()
    while engine.has_work():
        # With nobody waiting, every running sequence was prefilled in an earlier step: pure decode.
        pure_decode = engine.num_waiting == 0
        live = [s for s in lengths if s not in tokens or len(tokens[s]) < outs[order.index(s)]]
        t, c = time.perf_counter(), time.process_time()
        outputs = engine.step()
        dt, dc = time.perf_counter() - t, time.process_time() - c
        if pure_decode and outputs:
            decode_steps.append((dt, dc, len(outputs), sum(lengths[s] for s in live)))
        for out in outputs:
            tokens[out.seq_id] = out.output_token_ids
            lengths[out.seq_id] = out.prompt_tokens + len(out.output_token_ids)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "seconds": elapsed,
        "cpu_seconds": cpu,
        "start_s": start_s,
        "tokens": [tokens[s] for s in order],
        "decode_steps": decode_steps,
        "steps": engine.num_steps,
        "mean_batch": engine.sum_batch_size / max(1, engine.num_steps),
    }


def load_transformers(weights_dir: Path, prompt: list[int], pad_id: int) -> Any:
    """transformers' model on the float32 weights, warmed up with one short generate."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(weights_dir), dtype=torch.float32).eval()
    generate_batch(hf, [prompt[:8]], [4], pad_id)
    return hf


def hf_batches(outs: list[int], batch: int) -> list[list[int]]:
    """Request indices in batches of `batch`, in order of output length (a batch decodes
    until its longest request ends)."""
    order = sorted(range(len(outs)), key=lambda i: outs[i])
    return [order[b: b + batch] for b in range(0, len(order), batch)]


def generate_batch(hf: Any, prompts: list[list[int]], outs: list[int], pad_id: int) -> list[list[int]]:
    """One `generate` over the prompts, left-padded; each request's first outs[i] tokens."""
    width = max(len(p) for p in prompts)
    new = max(outs)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, width]
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):  # left padding
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=pad_id)
    return [out[row, width: width + o].tolist() for row, o in enumerate(outs)]


def run_transformers(hf: Any, prompts: list[list[int]], outs: list[int], batch: int,
                     pad_id: int) -> dict:
    tokens: dict[int, list[int]] = {}
    t0, c0 = time.perf_counter(), time.process_time()
    for group in hf_batches(outs, batch):
        got = generate_batch(hf, [prompts[i] for i in group], [outs[i] for i in group], pad_id)
        tokens.update(zip(group, got))
    return {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
            "tokens": [tokens[i] for i in range(len(prompts))]}


def same_tokens(a: list[list[int]], b: list[list[int]]) -> int:
    """Requests whose tokens are identical in both runs."""
    return sum(x == y for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=32)
    ap.add_argument("--hf-batches", default="4,8,16,32",
                    help="transformers' batch sizes to find its best among (each run once; the one with the least "
                         "CPU time is then timed beside the engine and transformers with every request in one "
                         "batch)")
    ap.add_argument("--weights", default="float32,as_file",
                    help="comma-separated weights choices for the engine, run side by side "
                         "(float32, q8_0, q4, as_file)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds, each running every contender once, alternated (medians)")
    ap.add_argument("--decode-batches", default="1,10,64",
                    help="also time pure-decode steps at these batch sizes (40-token prompts), each weights "
                         "choice in turn; empty to skip")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads for both sides, and the engine's packed products' threads "
                         "(default 1: this machine is shared)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from lamina.model.quant import set_kernel_threads

    set_kernel_threads(args.threads)  # the engine's products too

    from lamina.model.loader import load_model
    from lamina.model.packing import check_weights

    choices = [check_weights(w.strip()) for w in args.weights.split(",") if w.strip()]
    sizes = sorted({int(x) for x in args.hf_batches.split(",") if x.strip()})
    if not sizes or sizes[0] < 1:
        ap.error("--hf-batches needs positive batch sizes")
    work = load_workload(args.requests, args.seed, args.scale, args.max_prompt, args.max_output)
    models = {}
    for w in choices:
        t = time.perf_counter()
        models[w] = (load_model(weights=w), time.perf_counter() - t)
    first = models[choices[0]][0]
    cfg = first.config
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(100, cfg.vocab_size, (p,), generator=gen).tolist() for p, _ in work]
    outs = [o for _, o in work]
    total_out = sum(outs)

    print(f"workload: {len(work)} requests sampled with random.Random({args.seed}) from "
          f"{TRACES / 'azure_conv_2023.csv'}; lengths // {args.scale} (>= 1), prompt <= {args.max_prompt}, "
          f"output <= {args.max_output}; prompt tokens total {sum(p for p, _ in work)} "
          f"(mean {statistics.mean(p for p, _ in work):.1f}), output tokens total {total_out} "
          f"(mean {statistics.mean(outs):.1f}); random prompt ids, greedy, output length forced")
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"torch threads {torch.get_num_threads()}")
    for w, (loaded, load_s) in models.items():
        print(f"model: {loaded.source.name} with weights={w} {loaded.weight_formats} ({cfg.num_layers} layers, "
              f"hidden {cfg.hidden_size}); load {load_s:.1f} s (was_cached={loaded.was_cached})")

    pad_id = cfg.eos_token_ids[0]
    hf_model = load_transformers(first.weights_dir, prompts[0], pad_id)
    search: dict[int, dict] = {}
    for b in sizes:  # once each, to pick the size the rounds time
        search[b] = run_transformers(hf_model, prompts, outs, b, pad_id)
    # By CPU time: on a shared machine one wall time can be another process's.
    best = min(search, key=lambda b: search[b]["cpu_seconds"])
    print("transformers generate, batch size search (float32, one run each, in order of output length, "
          "left-padded; wall / CPU s): " + ", ".join(f"{b}: {r['seconds']:.2f} / {r['cpu_seconds']:.2f}"
                                                    for b, r in search.items()) + f"; best by CPU time {best}")

    hf_forms = {"same": len(prompts), "best": best}  # every request in one batch, as the engine; its best size
    contenders = [("engine", w) for w in choices] + [("hf", f) for f in hf_forms]
    runs: dict[tuple[str, str], list[dict]] = {c: [] for c in contenders}
    for r in range(args.repeat):  # alternated, so that load on the machine hits every contender alike
        for kind, name in contenders if r % 2 == 0 else contenders[::-1]:
            if kind == "engine":
                runs[kind, name].append(run_lamina(models[name][0], prompts, outs))
            else:
                runs[kind, name].append(run_transformers(hf_model, prompts, outs, hf_forms[name], pad_id))

    by_batch: dict[str, dict[int, float]] = {w: {} for w in choices}
    for b in (int(x) for x in args.decode_batches.split(",") if x.strip()):
        per: dict[str, list[float]] = {w: [] for w in choices}
        for _ in range(args.repeat):
            for w in choices:
                per[w].append(decode_step_cpu(models[w][0], b, 40, 12, args.seed, pick=statistics.median))
        for w in choices:
            by_batch[w][b] = statistics.median(per[w])
        print(f"decode step CPU time at batch {b} (40-token prompts, median of 12 steps): "
              + ", ".join(f"{w} {by_batch[w][b] * 1e3:.1f} ms" for w in choices))

    def medians(rs: list[dict]) -> tuple[float, float]:
        return statistics.median(r["seconds"] for r in rs), statistics.median(r["cpu_seconds"] for r in rs)

    hf: dict[str, dict] = {}
    for form, size in hf_forms.items():
        rs = runs["hf", form]
        seconds, cpu = medians(rs)
        hf[form] = {"seconds": seconds, "cpu_s": cpu, "tok_s": total_out / seconds, "batch": size,
                    "tokens": rs[0]["tokens"], "runs_s": [round(r["seconds"], 3) for r in rs]}
    label = {"same": f"all {len(prompts)} requests in one batch", "best": f"batches of {best}"}
    for form, h in hf.items():
        print(f"transformers generate, {label[form]}: {h['seconds']:.2f} s, {h['tok_s']:.1f} output tok/s, "
              f"{h['cpu_s']:.2f} CPU s (median of {len(h['runs_s'])}: {h['runs_s']} s)")
    print(f"  requests with identical tokens in both forms: {same_tokens(hf['same']['tokens'], hf['best']['tokens'])}"
          f"/{len(work)}")

    bw = copy_bandwidth()
    results = {}
    for w in choices:
        rs = runs["engine", w]
        seconds, cpu = medians(rs)
        tps = total_out / seconds
        weight_bytes = weight_bytes_read(models[w][0].model)
        steps = [st for r in rs for st in r["decode_steps"]]
        if steps:
            step_s = statistics.median(s for s, _, _, _ in steps)
            step_cpu_s = statistics.median(c for _, c, _, _ in steps)
            batch = statistics.median(b for _, _, b, _ in steps)
            kv_bytes = statistics.median(k for _, _, _, k in steps) * cfg.kv_bytes_per_token(4)
            bound_s = (weight_bytes + kv_bytes) / bw
        else:
            step_s = step_cpu_s = batch = kv_bytes = bound_s = float("nan")
        # The machine is shared: CPU seconds of each process are a steadier measure than wall time.
        vs = {form: {"ratio": tps / h["tok_s"], "ratio_cpu_time": h["cpu_s"] / cpu,
                     "identical_requests": same_tokens(rs[0]["tokens"], h["tokens"])} for form, h in hf.items()}
        print(f"lamina engine, weights={w}: {seconds:.2f} s, {tps:.1f} output tok/s, {cpu:.2f} CPU s "
              f"(median of {len(rs)}: {[round(r['seconds'], 3) for r in rs]} s), {rs[0]['steps']} steps, mean batch "
              f"{rs[0]['mean_batch']:.1f}; engine start (split) {rs[0]['start_s']:.2f} s, not counted")
        for form, v in vs.items():
            print(f"  against transformers, {label[form]}: {v['ratio']:.2f}x wall, {v['ratio_cpu_time']:.2f}x by CPU "
                  f"time; requests with identical tokens {v['identical_requests']}/{len(work)}")
        print(f"  decode step (median of {len(steps)} pure-decode steps, median batch {batch}): "
              f"{step_s * 1e3:.1f} ms ({step_cpu_s * 1e3:.1f} ms CPU); bandwidth bound {bound_s * 1e3:.1f} ms = "
              f"({weight_bytes / 2**20:.0f} MiB weights + {kv_bytes / 2**20:.1f} MiB KV) / {bw / 1e9:.1f} GB/s "
              f"copy bandwidth; {step_s / bound_s:.2f}x the bound")
        results[w] = {
            "tok_s": round(tps, 2), "seconds": round(seconds, 3), "cpu_s": round(cpu, 3),
            "runs_s": [round(r["seconds"], 3) for r in rs],
            **{f"{k}_{form}_batch": round(x, 3) if isinstance(x, float) else x
               for form, v in vs.items() for k, x in v.items()},
            "decode_step_ms": round(step_s * 1e3, 2), "decode_step_cpu_ms": round(step_cpu_s * 1e3, 2),
            "bandwidth_bound_ms": round(bound_s * 1e3, 2), "weight_bytes": weight_bytes,
            "decode_batch_median": batch, "engine_start_s": round(rs[0]["start_s"], 3),
            "formats": models[w][0].weight_formats,
            "decode_step_cpu_ms_by_batch": {b: round(v * 1e3, 2) for b, v in by_batch[w].items()},
        }

    # The table: every contender's medians, and the engine's ratios to each transformers form.
    heads = [f"engine / tf {f} batch ({hf_forms[f]})" for f in hf]
    print(f"\n{'contender, medians of ' + str(args.repeat) + ' round(s)':48s} {'s':>7s} {'tok/s':>7s} {'CPU s':>7s}  "
          + "  ".join(f"{h:>24s}" for h in heads) + "  (wall / CPU time)")
    for w in choices:
        res = results[w]
        ratios = (f"{res[f'ratio_{f}_batch']:.2f}x / {res[f'ratio_cpu_time_{f}_batch']:.2f}x" for f in hf)
        print(f"{'lamina engine, weights=' + w:48s} {res['seconds']:7.2f} {res['tok_s']:7.1f} {res['cpu_s']:7.2f}  "
              + "  ".join(f"{x:>24s}" for x in ratios))
    for form, h in hf.items():
        print(f"{'transformers (tf), ' + label[form]:48s} {h['seconds']:7.2f} {h['tok_s']:7.1f} {h['cpu_s']:7.2f}")
    print("(left padding changes transformers' float rounding, so a near-tie can flip a request; "
          f"load average {os.getloadavg()[0]:.1f})")
    head = results[choices[0]]
    print(json.dumps({
        "lamina_tok_s": head["tok_s"],
        "transformers_same_batch_tok_s": round(hf["same"]["tok_s"], 2),
        "transformers_best_batch_tok_s": round(hf["best"]["tok_s"], 2),
        "ratio_same_batch": head["ratio_same_batch"],
        "ratio_best_batch": head["ratio_best_batch"],
        "ratio_cpu_time_same_batch": head["ratio_cpu_time_same_batch"],
        "ratio_cpu_time_best_batch": head["ratio_cpu_time_best_batch"],
        "decode_step_ms": head["decode_step_ms"],
        "bandwidth_bound_ms": head["bandwidth_bound_ms"],
        "decode_step_cpu_ms": head["decode_step_cpu_ms"],
        "lamina_cpu_s": head["cpu_s"],
        "transformers": {form: {"batch": h["batch"], "seconds": round(h["seconds"], 3), "cpu_s": round(h["cpu_s"], 3),
                                "tok_s": round(h["tok_s"], 2), "runs_s": h["runs_s"]} for form, h in hf.items()},
        "hf_batch_search": {b: {"seconds": round(r["seconds"], 3), "cpu_s": round(r["cpu_seconds"], 3)}
                            for b, r in search.items()},
        "weights": results,
        "load_avg_1min": round(os.getloadavg()[0], 2),
        "copy_bandwidth_gb_s": round(bw / 1e9, 2),
        "requests": len(work),
        "output_tokens": total_out,
        "prompt_tokens": sum(p for p, _ in work),
        "repeat": args.repeat,
        "threads": torch.get_num_threads(),
        "cpu": cpu_model(),
        "seed": args.seed,
        "scale": args.scale,
    }))


if __name__ == "__main__":
    main()
