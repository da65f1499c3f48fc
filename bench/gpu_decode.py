"""Decode on one device: transformers, the local engine and the stack, side by side.

Workload: B sequences with contexts of C tokens (random token ids, so nothing is
shared) decoding S steps each, greedy, EOS ignored; decode throughput is measured from
the moment every sequence has its first token (on a GPU, the engine and the stack from a
step or two later: planner/measure/stack_run.py, `run_engine`; transformers: its generate of 1 + S
tokens minus its generate of 1, each with the static cache, after an untimed one of
1 + S). Models are `NAME:DTYPE` (NAME: `smollm2`, the default GGUF's weights, or a
`random:` shape, docs/model.md; a GPU machine gets no GGUF, so the default list has
SmolLM2's shape as `random:smollm2-135m`). A point runs only where twice its weights and
KV (the engine's and transformers' copies) fit in 80% of the device's free memory, read
before the engine moves the model there; others are listed as skipped. The stack runs
at a point where its prefill and model workers' weights and the KV fit the same way.

Contenders, for each model, batch and context, in one run on the same device, one after
another (each one's memory given back to the device before the next):
- transformers' `generate` with `cache_implementation="static"`, loaded once per model,
  eager (`disable_compile`: its compile of the decode step would land in the timings);
- the local engine on the device (`lamina.engine`, torch's linears in the dtype; on a
  GPU each decode step replayed whole as a CUDA graph, lamina.model.step_graphs),
  after an untimed run of the same batch with short prompts (Triton compiles its
  kernels' variants for the first steps, the graphs of the batch's bucket are captured)
  and an untimed step of the timed batch (the graphs of its context bucket);
  `engine_slices`: the same engine with its step graphs off (its decode slices replayed
  as CUDA graphs, as the stack's model worker's are, their attention eager), measured
  alternately with the whole steps (slices, whole, slices after the first whole run;
  the best of each);
- the stack as `lamina up --device D --dtype T` starts it (every service on the one
  device; transport cuda_ipc on a GPU, tcp on the CPU; `--transport` names another), one
  model worker: colocated (attending on the device itself: what `lamina up --device cuda`
  starts, docs/services.md, Layouts), then with 2 and 1 micro-batches each over 1 and 2
  attention workers (`--no-stack`: left out; runs in that order, so that a run cut short
  keeps the layout users get and the issue's 2 micro-batches first; `colocated_slices`,
  right after colocated: the same with model_worker.step_graphs off, its decode slices'
  graphs and its core's per-layer attention graphs instead; `mb2_aw1_dev` and
  `mb1_aw1_dev`, last: 2 and 1 micro-batches over 1 attention worker with cuda_ipc's
  frames ordered on the GPU, `data_plane.cuda_ipc_device_order`, printed against the same
  runs ordered by the hosts; over cuda_ipc only), each warmed up with
  the whole batch, short (planner/measure/stack_run.py), and timed
  over S steps of the whole batch: each request may make `--stack-hold` more tokens, so
  the sequences prefilled first still decode when the last one has made its S (the
  streams are closed there; an error where the hold was too short);
- attention alone per layer: the attention worker's core (its decode frames replayed as
  CUDA graphs, as the service's are) against the engine's eager attention, on the device
  (bench/decode_pipeline.py's `attention_per_layer`).

The engine's decode throughput is timed over exactly S steps of the whole batch (each
sequence's token budget leaves room for the steps the first sequences decode while the
last prompts are prefilled; a timed step without every sequence is an error), then what
is left is aborted. Per point it also prints the engine's step against the bandwidth
bound, recorded as soon as the engine's figure is: the bytes a decode step must read
(every weight once, except an untied embedding table, of which a step reads B rows;
every sequence's KV at the window's mean length, C + 2 + S/2) over the device's copy
bandwidth measured in the same run (the fastest of five 1 GiB copies, the estimator of
`lamina profile`). Prints the device, the workload and a table (with the ratios
engine/transformers, the stack's 2 micro-batches/engine and colocated/engine, step/bound); a point's row is
appended to `--out` (JSON lines) after each contender, with what it has so far (a
contender that fails leaves its error in the row, `NAME_error`, and the others run); the
last line is one JSON object: {"device", "engine_tok_s", "engine_slices_tok_s", "transformers_tok_s",
"stack_tok_s": {"mb1", "mb2", "mb1_dev", "mb2_dev", "colocated", "colocated_slices"}, "step_vs_bound",
"attention_ms_per_layer": {"worker", "engine"}, "skipped", "errors"}, each keyed by
"model/dtype/bB/cC" (mb1 and mb2: the faster of 1 and 2 attention workers; mb1_dev and
mb2_dev: the same with cuda_ipc's frames ordered on the GPU).

    python bench/gpu_decode.py                 # on CUDA: the issue's matrix
    python bench/gpu_decode.py --device cpu --quick   # SmolLM2 float32, small points (a check of the script)
    python bench/gpu_decode.py --models random:llama-3.2-1b:bfloat16 --batches 64 --contexts 2048 \
        --contenders engine,colocated,mb2_aw1     # some of the contenders only
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from decode_pipeline import attention_per_layer  # bench/'s own (a script's folder is on its path)

from lamina.model.hf_reference import reference_model
from lamina.planner.measure.kernels import copy_bandwidth, synchronize
from lamina.planner.measure.stack_run import run_stack
from lamina.services.tracing import Tracer


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


def free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def prompts_of(batch: int, context: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(batch * 100_003 + context)
    return torch.randint(100, min(vocab, 49_152), (batch, context), generator=gen).tolist()


def make_engine(loaded, dtype: str, max_batch: int, max_context: int, kv_bytes: int, device: torch.device):
    """One engine per model, for all its points: it splits the model while it is still on
    the CPU (the split traces it there), then moves it to the device. A step's token
    budget holds the longest prompt beside every other sequence's decode token: a
    prompt as long as the budget would otherwise wait until nothing else runs."""
    from lamina.engine import Engine, EngineConfig
    from lamina.engine.scheduler import SchedulerLimits

    limits = SchedulerLimits(max_batch_size=max_batch, max_step_tokens=max(8192, max_context + max_batch))
    return Engine(loaded, EngineConfig(kv_capacity_bytes=kv_bytes, device=str(device), dtype=dtype, limits=limits))


def measure(row: dict[str, Any], name: str, record: Callable[[dict[str, Any]], None], run: Callable[..., Any],
            *args: Any, **kwargs: Any) -> None:
    """One contender at one point: row[name] = run(*args, **kwargs), or its error as
    row[name + "_error"], recorded at once (a failure loses that figure alone, and a run
    cut short keeps what it measured)."""
    try:
        row[name] = run(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 (any failure of a contender is its result)
        traceback.print_exc()
        row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[-2000:]
    record(row)


def stack_tok_s(*args: Any, **kwargs: Any) -> float:
    """The stack's decode tokens/s (planner/measure/stack_run.run_stack's arguments); the
    run's other figures (its workers' shares of the window) are printed."""
    result = run_stack(*args, **kwargs)
    print("stack run:", json.dumps(result), flush=True)
    return result["tok_s"]


def attention_slab(per_seq: int, batch: int, workers: int) -> int:
    """Each of `workers` attention workers' KV bytes for a batch of sequences of `per_seq`
    bytes each: its share under request partitioning (the least reserved worker takes
    the next sequence), one sequence more where there are several."""
    return per_seq * (-(-batch // workers) + (workers > 1))


def release(device: torch.device) -> None:
    """The device memory a contender left in the caching allocator, given back (the next
    one, or the stack's processes, need it)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def warm_then_run_engine(engine, prompts: list[list[int]], steps: int, trace: Path | None = None) -> float:
    """run_engine after an untimed run of the same batch, short (its first steps: Triton
    compiles its kernels' variants for them)."""
    run_engine(engine, [p[:64] for p in prompts], 2)
    return run_engine(engine, prompts, steps, trace)


def slices_alternately(engine, prompts: list[list[int]], steps: int, row: dict[str, Any]) -> float:
    """The engine with its decode slices' graphs only (step graphs off) against its whole
    steps' graphs, measured alternately after the whole steps' first run (row's
    engine_tok_s): slices, whole, slices. Returns the slices' best and keeps the whole
    steps' best in the row."""
    whole_graphs = engine.step_graphs
    best = 0.0
    for whole in (False, True, False):
        engine.step_graphs = whole_graphs if whole else None
        try:
            tok_s = warm_then_run_engine(engine, prompts, steps) if not whole and not best else \
                run_engine(engine, prompts, steps)
        finally:
            engine.step_graphs = whole_graphs
        if whole:
            row["engine_tok_s"] = max(row["engine_tok_s"], tok_s)
        else:
            best = max(best, tok_s)
    return best


def run_engine(engine, prompts: list[list[int]], steps: int, trace: Path | None = None) -> float:
    """The engine's decode tokens/s over `steps` steps of the whole batch, timed from the
    step after every sequence has its first token (that untimed step is the whole batch's
    first at the prompts' length: on a GPU it captures the step graph of that context
    bucket, lamina.model.step_graphs.context_bucket, which a warm-up with short prompts
    does not reach). Each prompt step admits at least one prompt, and the sequences
    already decoding take a token in it: a budget of steps + 3 + B tokens outlasts the
    prompt steps, the untimed one and the timed ones. Every sequence is aborted after (or on
    an error), so the engine is empty for the next point. `trace`: a torch.profiler
    trace of the timed steps written there (services/tracing.py's files)."""
    from lamina.engine import SamplingParams

    params = SamplingParams(max_tokens=steps + 3 + len(prompts), temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    try:
        first: set[str] = set()
        while len(first) < len(prompts):  # prefill and the first token of every prompt: not timed
            first.update(o.seq_id for o in engine.step())
        engine.step()  # the whole batch's first decode step at this length: not timed
        tracer = None if trace is None else Tracer("engine", trace)
        if tracer is not None:
            tracer.start()
        try:
            start = time.perf_counter()
            for _ in range(steps):
                made = len(engine.step())  # each step ends on the CPU (its tokens): synchronized
                if made != len(prompts):
                    raise RuntimeError(f"a timed step ran {made} of the batch's {len(prompts)} sequences")
            elapsed = time.perf_counter() - start
        finally:  # a failed step too: the next contender's trace could not start beside this one
            if tracer is not None:
                tracer.stop()
    finally:
        for seq_id in ids:
            engine.abort(seq_id)
    return len(prompts) * steps / elapsed


def step_against_bound(row: dict[str, Any], point: Point, read_bytes: int, kv_bytes_per_token: int,
                       steps: int, bandwidth: float) -> None:
    """The engine's step and the bandwidth bound into the row (ms): the weight bytes a step
    reads and every sequence's KV at the timed window's mean length (run_engine's window
    starts with C + 2 keys)."""
    step_s = point.batch / row["engine_tok_s"]
    bound_s = (read_bytes + point.batch * (point.context + 2 + steps / 2) * kv_bytes_per_token) / bandwidth
    row["step_ms"], row["bound_ms"] = 1e3 * step_s, 1e3 * bound_s


def run_transformers(hf: Any, point: Point, prompts: list[list[int]], steps: int, device: torch.device) -> float:
    """transformers' decode tokens/s: its generate of 1 + S tokens minus its generate of 1,
    after one untimed generate of 1 + S (the static cache's first allocation at that
    length, and whatever else a first call does)."""
    ids = torch.tensor(prompts, device=device)  # [B, C]
    mask = torch.ones_like(ids)

    def generate(n: int) -> float:
        synchronize(device)
        t = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                        cache_implementation="static", pad_token_id=0)
        synchronize(device)
        return time.perf_counter() - t

    generate(1 + steps)  # warm-up, at the timed length
    one, many = generate(1), generate(1 + steps)
    return point.batch * steps / max(many - one, 1e-9)


# The disaggregated stack's runs, in the order they run: (micro-batches, attention workers,
# "_dev" where cuda_ipc's frames are device-ordered, data_plane.cuda_ipc_device_order).
STACK_RUNS = ((2, 1, ""), (2, 2, ""), (1, 1, ""), (1, 2, ""), (2, 1, "_dev"), (1, 1, "_dev"))
# What --contenders names: the engine, transformers, attention alone, and the stack's runs.
CONTENDERS = ("engine", "engine_slices", "transformers", "attention", "colocated", "colocated_slices", "mb2_aw1",
              "mb2_aw2", "mb1_aw1", "mb1_aw2", "mb2_aw1_dev", "mb1_aw1_dev")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", default=None,
                    help="NAME:DTYPE,... (default: random:llama-3.1-8b:bfloat16,random:llama-3.2-1b:bfloat16,"
                         "random:smollm2-135m:float32; --quick: smollm2:float32)")
    ap.add_argument("--batches", default=None, help="default 1,16,64,256 (--quick: 1,4)")
    ap.add_argument("--contexts", default=None, help="default 512,2048,8192 (--quick: 128)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps timed (default 32; --quick: 8)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--stack", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--stack-hold", type=int, default=1024,
                    help="tokens a stack request may make beyond S + 1, at least those its sequence decodes while the "
                         "last prompts are prefilled (default 1024; the KV holds them too)")
    ap.add_argument("--transport", default=None, choices=("tcp", "shm", "ucx", "cuda_ipc"),
                    help="the stack's data plane (default cuda_ipc on a GPU, tcp on the CPU)")
    ap.add_argument("--out", default=None, help="append each row as a JSON line to this file")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="torch.profiler traces into DIR, a folder per point and contender: the engine's timed "
                         "steps, and each stack run's model and attention workers over its window "
                         "(services/tracing.py); the figures then include the profiler's cost")
    ap.add_argument("--contenders", default=",".join(CONTENDERS),
                    help=f"which to run, of {','.join(CONTENDERS)} (default all; the engine's step is measured "
                         "whenever `engine` is named, and the stack's runs only with --stack)")
    args = ap.parse_args()
    chosen = set(args.contenders.split(","))
    if chosen - set(CONTENDERS):
        ap.error(f"--contenders: unknown {sorted(chosen - set(CONTENDERS))}; known: {','.join(CONTENDERS)}")
    device = torch.device(args.device)
    quick = args.quick
    models = args.models or ("smollm2:float32" if quick else
                             "random:llama-3.1-8b:bfloat16,random:llama-3.2-1b:bfloat16,random:smollm2-135m:float32")
    batches = [int(x) for x in (args.batches or ("1,4" if quick else "1,16,64,256")).split(",")]
    contexts = [int(x) for x in (args.contexts or ("128" if quick else "512,2048,8192")).split(",")]
    steps = args.steps or (8 if quick else 32)
    transport = args.transport or ("cuda_ipc" if device.type == "cuda" else "tcp")
    bandwidth = copy_bandwidth((1 << 30) if device.type == "cuda" else (128 << 20), 5, device)
    release(device)  # the copies' buffers, before the fit checks read the free memory
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    print(f"device: {device} ({name}), copy bandwidth {bandwidth / 1e9:.0f} GB/s; torch {torch.__version__}")
    print(f"workload: batches {batches}, contexts {contexts}, {steps} decode steps timed, greedy, EOS ignored; "
          f"the stack over {transport}; decode slices as CUDA graphs (engine and model worker): "
          f"{device.type == 'cuda'}")
    out_file = Path(args.out) if args.out else None

    def traced(point: Point, contender: str) -> Path | None:
        """Where a contender's trace goes at a point, with --trace."""
        return None if args.trace is None else Path(args.trace) / f"{point.key.replace('/', '-')}-{contender}"

    report: dict[str, Any] = {"device": f"{device} ({name})", "engine_tok_s": {}, "engine_slices_tok_s": {},
                              "transformers_tok_s": {},
                              "stack_tok_s": {"mb1": {}, "mb2": {}, "mb1_dev": {}, "mb2_dev": {},
                                              "colocated": {}, "colocated_slices": {}},
                              "step_vs_bound": {},
                              "attention_ms_per_layer": {"worker": {}, "engine": {}}, "skipped": [],
                              "errors": {}}

    def record(row: dict[str, Any]) -> None:
        print(json.dumps(row), flush=True)
        if out_file is not None:
            with out_file.open("a") as f:
                f.write(json.dumps(row) + "\n")

    from lamina.model.loader import load_model

    all_rows: dict[str, dict[str, Any]] = {}  # every point's row, by key

    for spec in models.split(","):
        model, _, dtype = spec.rpartition(":")
        loaded = load_model(None if model == "smollm2" else model, dtype=getattr(torch, dtype), packed=False)
        cfg, weights_dir = loaded.config, loaded.weights_dir
        elem = getattr(torch, dtype).itemsize
        weight_bytes = sum(p.numel() for p in loaded.model.parameters()) * elem
        # What a decode step reads of them: all, but of an untied embedding table only the
        # batch's rows (the head's own matrix is read whole).
        read_bytes = weight_bytes - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * elem)
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
        rows: dict[str, dict[str, Any]] = {p.key: {"point": p.key, "steps": steps} for p, _, _ in points}
        all_rows.update(rows)

        engine = make_engine(loaded, dtype, max(p.batch for p, _, _ in points), max(p.context for p, _, _ in points),
                             max(kv for _, _, kv in points), device) if "engine" in chosen else None
        for point, prompts, _ in points if engine is not None else ():
            row = rows[point.key]
            measure(row, "engine_tok_s", record, warm_then_run_engine, engine, prompts, steps,
                    traced(point, "engine"))
            if "engine_slices" in chosen and "engine_tok_s" in row and engine.step_graphs is not None:
                measure(row, "engine_slices_tok_s", record, slices_alternately, engine, prompts, steps, row)
            if "engine_tok_s" in row:  # recorded now: a run cut short later keeps it
                step_against_bound(row, point, read_bytes, cfg.kv_bytes_per_token(elem), steps, bandwidth)
                record(row)
        del engine, loaded
        release(device)  # the device's memory for transformers, then the stack
        if "transformers" in chosen:
            hf = reference_model(weights_dir, getattr(torch, dtype), device)
            for point, prompts, _ in points:
                measure(rows[point.key], "transformers_tok_s", record, run_transformers, hf, point, prompts, steps,
                        device)
            del hf
            release(device)
        for point, _, _ in points if "attention" in chosen else ():
            measure(rows[point.key], "attention_ms_per_layer", record, attention_per_layer, cfg, point.batch,
                    point.context, 5, str(device), dtype)
            release(device)
        weights = "as_file" if dtype == "float32" and device.type == "cpu" else "float32"
        for point, prompts, kv_bytes in points if args.stack else ():
            hold = max(0, min(args.stack_hold, cfg.max_position_embeddings - point.context - steps - 3))
            per_seq = kv_bytes // point.batch + hold * cfg.kv_bytes_per_token(elem)
            # Every service on the one device: the prefill's and the model worker's weights, the KV.
            if 2 * weight_bytes + max(w * attention_slab(per_seq, point.batch, w) for w in (1, 2)) \
                    > 0.8 * free_bytes(device):
                rows[point.key]["stack_error"] = "does not fit: the prefill's and model worker's weights and the KV"
                record(rows[point.key])
                continue
            for name, whole in (("colocated", True), ("colocated_slices", False)):
                if name in chosen:
                    measure(rows[point.key], f"stack_{name}_tok_s", record, stack_tok_s, prompts, steps, transport,
                            1, False, 1, attention_slab(per_seq, point.batch, 1) + (256 << 20), weights,
                            layout="colocated", model=point.checkpoint, device=str(device), dtype=dtype, hold=hold,
                            trace_dir=traced(point, name), step_graphs=whole)
            for mb, workers, suffix in STACK_RUNS:
                name = f"mb{mb}_aw{workers}{suffix}"
                if name not in chosen or (suffix == "_dev" and transport != "cuda_ipc"):
                    continue  # device order is cuda_ipc's: over another transport the same as without
                slab = attention_slab(per_seq, point.batch, workers) + (256 << 20)
                measure(rows[point.key], f"stack_{name}_tok_s", record, stack_tok_s, prompts, steps,
                        transport, mb, False, 1, slab, weights, attention_workers=workers,
                        model=point.checkpoint, device=str(device), dtype=dtype, hold=hold,
                        trace_dir=traced(point, name), device_order=suffix == "_dev")
        for point, _, _ in points:
            row, key = rows[point.key], point.key
            if "engine_tok_s" in row:
                report["engine_tok_s"][key] = row["engine_tok_s"]
                report["step_vs_bound"][key] = row["step_ms"] / row["bound_ms"]
            if "engine_slices_tok_s" in row:
                report["engine_slices_tok_s"][key] = row["engine_slices_tok_s"]
            if "transformers_tok_s" in row:
                report["transformers_tok_s"][key] = row["transformers_tok_s"]
            for side in ("worker", "engine"):
                if "attention_ms_per_layer" in row:
                    report["attention_ms_per_layer"][side][key] = row["attention_ms_per_layer"][side]
            for mb in (1, 2):
                for suffix in ("", "_dev"):
                    best = max(row.get(f"stack_mb{mb}_aw{w}{suffix}_tok_s", 0.0) for w in (1, 2))
                    if best:
                        report["stack_tok_s"][f"mb{mb}{suffix}"][key] = best
            for name in ("colocated", "colocated_slices"):
                if f"stack_{name}_tok_s" in row:
                    report["stack_tok_s"][name][key] = row[f"stack_{name}_tok_s"]
            report["errors"].update({f"{key} {k}": v for k, v in row.items() if k.endswith("_error")})
    print(f"\n{'point':<32} {'engine':>9} {'transformers':>13} {'eng/hf':>7} {'stack mb1':>10} {'stack mb2':>10} "
          f"{'mb2/eng':>8} {'colocated':>10} {'col/eng':>8} {'step/bound':>11} {'attn w/e ms':>12}")
    for key, eng in report["engine_tok_s"].items():
        hf = report["transformers_tok_s"].get(key, float("nan"))
        stack = report["stack_tok_s"]
        mb1, mb2, col = (stack[k].get(key) for k in ("mb1", "mb2", "colocated"))
        w = report["attention_ms_per_layer"]["worker"].get(key, float("nan"))
        e = report["attention_ms_per_layer"]["engine"].get(key, float("nan"))
        print(f"{key:<32} {eng:>9.1f} {hf:>13.1f} {eng / hf:>6.2f}x {mb1 or 0:>10.1f} {mb2 or 0:>10.1f} "
              f"{(mb2 or float('nan')) / eng:>7.2f}x {col or 0:>10.1f} {(col or float('nan')) / eng:>7.2f}x "
              f"{report['step_vs_bound'][key]:>10.2f}x {w:>5.2f}/{e:<5.2f}")
    for key, sliced in report["engine_slices_tok_s"].items():
        whole = report["engine_tok_s"][key]
        print(f"{key}: engine {whole:.1f} tok/s with whole steps as CUDA graphs, {sliced:.1f} with its slices' "
              f"graphs only: {whole / sliced:.2f}x (alternately, best of two each)")
    for key, sliced in report["stack_tok_s"]["colocated_slices"].items():
        whole = report["stack_tok_s"]["colocated"].get(key)
        if whole:
            print(f"{key}: stack colocated {whole:.1f} tok/s with whole steps as CUDA graphs, {sliced:.1f} with its "
                  f"slices' graphs only: {whole / sliced:.2f}x (one after the other)")
    for mb in (1, 2):
        for key, dev in report["stack_tok_s"][f"mb{mb}_dev"].items():
            host = all_rows.get(key, {}).get(f"stack_mb{mb}_aw1_tok_s", 0.0)
            if host:
                print(f"{key}: stack, {mb} micro-batch(es), 1 attention worker: {dev:.1f} tok/s with cuda_ipc's frames "
                      f"ordered on the GPU, {host:.1f} ordered by the hosts: {dev / host:.2f}x (one after the other)")
    for what, error in report["errors"].items():
        print(f"failed: {what}: {error.splitlines()[-1] if error else ''}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
