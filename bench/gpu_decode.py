"""Decode on one device: transformers, the local engine and the stack, side by side.

Workload: B sequences with contexts of C tokens (random token ids, so nothing is
shared) decoding S steps each, greedy, EOS ignored; decode throughput is measured from
the moment every sequence has its first token (transformers: its generate of 1 + S
tokens minus its generate of 1, each with the static cache). Models are
`NAME:DTYPE` (NAME: `smollm2`, the default GGUF's weights, or a `random:` shape,
docs/model.md). A point runs only where twice its weights and KV (the engine's and
transformers' copies) fit in 80% of the device's free memory, read before the engine
moves the model there; others are listed as skipped.

Contenders, for each model, batch and context, in one run on the same device:
- transformers' `generate` with `cache_implementation="static"`;
- the local engine on the device (`lamina.engine`, torch's linears in the dtype);
- the stack as `lamina up --device D --dtype T` starts it (every service on the one
  device; transport cuda_ipc on a GPU, tcp on the CPU; `--transport` names another), one
  model worker, 1 and 2 attention workers, 1 and 2 micro-batches (`--no-stack`: left out);
- attention alone per layer: the attention worker's core against the engine's
  attention, on the device (bench/decode_pipeline.py's `attention_per_layer`).

Per point it also prints the engine's step against the bandwidth bound: the bytes a
decode step must read (the weights once, every sequence's KV) over the device's copy
bandwidth measured in the same run (the fastest of five 1 GiB copies, the estimator of
`lamina profile`). Prints the device, the workload and a table; every
row is appended to `--out` (JSON lines) as it is measured; the last line is one JSON
object: {"device", "engine_tok_s", "transformers_tok_s", "stack_tok_s": {"mb1", "mb2"},
"step_vs_bound", "attention_ms_per_layer": {"worker", "engine"}}, each keyed by
"model/dtype/bB/cC".

    python bench/gpu_decode.py                 # on CUDA: the issue's matrix
    python bench/gpu_decode.py --device cpu --quick   # SmolLM2 float32, small points (a check of the script)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from decode_pipeline import attention_per_layer  # bench/'s own (a script's folder is on its path)

from lamina.planner.measure.kernels import copy_bandwidth
from lamina.planner.measure.stack_run import run_stack


@dataclass(frozen=True)
class Point:
    model: str  # the NAME of a --models entry: smollm2 (the default checkpoint) or a random: spec
    dtype: str
    batch: int
    context: int

    @property
    def key(self) -> str:
        return f"{self.model.removeprefix('random:')}/{self.dtype}/b{self.batch}/c{self.context}"

    @property
    def checkpoint(self) -> str | None:
        return None if self.model == "smollm2" else self.model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def prompts_of(batch: int, context: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(batch * 100_003 + context)
    return torch.randint(100, min(vocab, 49_152), (batch, context), generator=gen).tolist()


def make_engine(loaded, dtype: str, max_batch: int, kv_bytes: int, device: torch.device):
    """One engine per model, for all its points: it splits the model while it is still on
    the CPU (the split traces it there), then moves it to the device."""
    from lamina.engine import Engine, EngineConfig
    from lamina.engine.scheduler import SchedulerLimits

    return Engine(loaded, EngineConfig(kv_capacity_bytes=kv_bytes, device=str(device), dtype=dtype,
                                       limits=SchedulerLimits(max_batch_size=max_batch, max_step_tokens=8192)))


def run_engine(engine, prompts: list[list[int]], steps: int) -> float:
    from lamina.engine import SamplingParams

    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    first: set[str] = set()
    while len(first) < len(prompts):  # prefill and the first token of every prompt: not timed
        first.update(o.seq_id for o in engine.step())
    tokens, start = 0, time.perf_counter()
    while engine.has_work():
        tokens += sum(len(o.new_token_ids) for o in engine.step())  # each step ends on the CPU: synchronized
    return tokens / (time.perf_counter() - start)


def run_transformers(weights_dir: Path, point: Point, prompts: list[list[int]], steps: int,
                     device: torch.device) -> float:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(weights_dir), dtype=getattr(torch, point.dtype)).to(device).eval()
    ids = torch.tensor(prompts, device=device)  # [B, C]
    mask = torch.ones_like(ids)

    def generate(n: int) -> float:
        sync(device)
        t = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                        cache_implementation="static", pad_token_id=0)
        sync(device)
        return time.perf_counter() - t

    generate(2)  # warm-up
    one, many = generate(1), generate(1 + steps)
    return point.batch * steps / max(many - one, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", default=None,
                    help="NAME:DTYPE,... (default: random:llama-3.1-8b:bfloat16,random:llama-3.2-1b:bfloat16,"
                         "smollm2:float32; --quick: smollm2:float32)")
    ap.add_argument("--batches", default=None, help="default 1,16,64,256 (--quick: 1,4)")
    ap.add_argument("--contexts", default=None, help="default 512,2048,8192 (--quick: 128)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps timed (default 32; --quick: 8)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--stack", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--transport", default=None, choices=("tcp", "shm", "ucx", "cuda_ipc"),
                    help="the stack's data plane (default cuda_ipc on a GPU, tcp on the CPU)")
    ap.add_argument("--out", default=None, help="append each row as a JSON line to this file")
    args = ap.parse_args()
    device = torch.device(args.device)
    quick = args.quick
    models = args.models or ("smollm2:float32" if quick else
                             "random:llama-3.1-8b:bfloat16,random:llama-3.2-1b:bfloat16,smollm2:float32")
    batches = [int(x) for x in (args.batches or ("1,4" if quick else "1,16,64,256")).split(",")]
    contexts = [int(x) for x in (args.contexts or ("128" if quick else "512,2048,8192")).split(",")]
    steps = args.steps or (8 if quick else 32)
    transport = args.transport or ("cuda_ipc" if device.type == "cuda" else "tcp")
    bandwidth = copy_bandwidth((1 << 30) if device.type == "cuda" else (128 << 20), 5, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    print(f"device: {device} ({name}), copy bandwidth {bandwidth / 1e9:.0f} GB/s; torch {torch.__version__}")
    print(f"workload: batches {batches}, contexts {contexts}, {steps} decode steps timed, greedy, EOS ignored; "
          f"the stack over {transport}")
    out_file = Path(args.out) if args.out else None
    report: dict[str, Any] = {"device": f"{device} ({name})", "engine_tok_s": {}, "transformers_tok_s": {},
                              "stack_tok_s": {"mb1": {}, "mb2": {}}, "step_vs_bound": {},
                              "attention_ms_per_layer": {"worker": {}, "engine": {}}, "skipped": []}

    def record(row: dict[str, Any]) -> None:
        print(json.dumps(row), flush=True)
        if out_file is not None:
            with out_file.open("a") as f:
                f.write(json.dumps(row) + "\n")

    from lamina.model.loader import load_model

    for spec in models.split(","):
        model, _, dtype = spec.rpartition(":")
        loaded = load_model(None if model == "smollm2" else model, packed=False)
        cfg, weights_dir = loaded.config, loaded.weights_dir
        elem = getattr(torch, dtype).itemsize
        weight_bytes = sum(p.numel() for p in loaded.model.parameters()) * elem
        points: list[tuple[Point, list[list[int]], int]] = []  # (point, prompts, KV bytes)
        for context in contexts:
            for batch in batches:
                point = Point(model, dtype, batch, context)
                kv_bytes = batch * (context + steps + 128) * cfg.kv_bytes_per_token(elem)
                # The engine's weights and KV, and transformers' (loaded one after the other).
                if 2 * (weight_bytes + kv_bytes) > 0.8 * free_bytes(device) \
                        or context + steps > cfg.max_position_embeddings:
                    report["skipped"].append(point.key)
                    record({"point": point.key, "skipped": "does not fit"})
                    continue
                points.append((point, prompts_of(batch, context, cfg.vocab_size), kv_bytes))
        if not points:
            continue
        rows: dict[str, dict[str, Any]] = {p.key: {"point": p.key} for p, _, _ in points}
        engine = make_engine(loaded, dtype, max(p.batch for p, _, _ in points), max(kv for _, _, kv in points),
                             device)
        for point, prompts, _ in points:
            rows[point.key]["engine_tok_s"] = run_engine(engine, prompts, steps)
        del engine, loaded  # the device's memory for transformers, then the stack
        for point, prompts, _ in points:
            rows[point.key]["transformers_tok_s"] = run_transformers(weights_dir, point, prompts, steps, device)
            rows[point.key]["attention_ms_per_layer"] = attention_per_layer(cfg, point.batch, point.context, 5,
                                                                            str(device), dtype)
        for point, prompts, kv_bytes in points if args.stack else ():
            row = rows[point.key]
            for mb in (1, 2):
                for workers in (1, 2):
                    try:
                        run = run_stack(prompts, steps, transport, mb, False, 1, kv_bytes + (256 << 20),
                                        "as_file" if dtype == "float32" and device.type == "cpu" else "float32",
                                        attention_workers=workers, model=point.checkpoint, device=str(device),
                                        dtype=dtype)
                        row[f"stack_mb{mb}_aw{workers}_tok_s"] = run["tok_s"]
                    # A stack that fails to start or to serve is reported; the other contenders stand.
                    except (RuntimeError, OSError, ValueError, TimeoutError) as exc:
                        row[f"stack_mb{mb}_aw{workers}_error"] = f"{type(exc).__name__}: {exc}"[:300]
        for point, _, _ in points:
            row, key = rows[point.key], point.key
            step_s = point.batch / row["engine_tok_s"]
            bound_s = (weight_bytes + point.batch * point.context * cfg.kv_bytes_per_token(elem)) / bandwidth
            row["step_ms"], row["bound_ms"] = 1e3 * step_s, 1e3 * bound_s
            record(row)
            report["engine_tok_s"][key] = row["engine_tok_s"]
            report["transformers_tok_s"][key] = row["transformers_tok_s"]
            report["step_vs_bound"][key] = step_s / bound_s
            for side in ("worker", "engine"):
                report["attention_ms_per_layer"][side][key] = row["attention_ms_per_layer"][side]
            for mb in (1, 2):
                best = max(row.get(f"stack_mb{mb}_aw{w}_tok_s", 0.0) for w in (1, 2))
                if best:
                    report["stack_tok_s"][f"mb{mb}"][key] = best
    print(f"\n{'point':<32} {'engine':>9} {'transformers':>13} {'eng/hf':>7} {'stack mb1':>10} {'stack mb2':>10} "
          f"{'step/bound':>11} {'attn w/e ms':>12}")
    for key, eng in report["engine_tok_s"].items():
        hf = report["transformers_tok_s"][key]
        mb1, mb2 = report["stack_tok_s"]["mb1"].get(key), report["stack_tok_s"]["mb2"].get(key)
        w, e = report["attention_ms_per_layer"]["worker"][key], report["attention_ms_per_layer"]["engine"][key]
        print(f"{key:<32} {eng:>9.1f} {hf:>13.1f} {eng / hf:>6.2f}x {mb1 or 0:>10.1f} {mb2 or 0:>10.1f} "
              f"{report['step_vs_bound'][key]:>10.2f}x {w:>5.2f}/{e:<5.2f}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
