"""Planner validation: the planner's predicted decode step against the local engine's
measured one, on this machine, from a fresh `lamina profile`.

Cases: SmolLM2-135M-Instruct (float32 weights and KV, the engine's default) at batch
sizes 1 to 32 and prompts of 32 to 512 tokens; each case is the fastest CPU time of
--steps pure-decode steps after one prefill step (lamina.planner.measure.engine_step's
decode_step_cpu; the profile's kernels are each their fastest too), with one torch
thread, against lamina.planner.estimate.decode_step for a colocated layout on
`this-machine` (float32) at the same batch and mean context. The profile is measured
first in this process (planner/profile.py, --quick: fewer repeats); its overhead terms
are calibrated on the engine at other points (planner.profile.OVERHEAD_POINTS: 16-token
prompts), so no case here is one it was fitted to.

--stack adds the stack as `lamina up` starts it (lamina.planner.measure.stack_run's run_stack:
one model worker, TCP, float32 weights; batch 32, prompts of 256 tokens, 32 decode
steps) with 1 and 2 attention workers at 1 and 2 micro-batches, each measured in
--rounds passes alternating with the others (each pass its own stack), its fastest
counting: decode tokens/s against the planner's disaggregated layout on `this-machine`
with `shared_host` (every service on this host's cores: the profile's per-slice,
per-frame and per-exchange overheads, calibrated on a smaller stack run, and the host's
CPU work over its cores).

--out-of-sample adds cases the calibration never touched (OUT_OF_SAMPLE, 30 of them), in
families: the engine with other model shapes (seeded random-weight SmolLM2-360M- and
-1.7B-shaped models, SmolLM2's vocabulary), with contexts up to 4,096 tokens, with two
threads (against a profile measured with two); the stack, colocated against
disaggregated with 1-2 attention workers and 1-3 micro-batches, for SmolLM2-135M and the
360M shape; and the stack colocated on 1 and 2 model threads at two points (predicted
from the one-thread profile and its measured speedup on two threads, as `lamina up`
ranks them); and the stack colocated with the default GGUF's own Q4_1 blocks against the
same values in float32 at two points (as `lamina up` ranks its weights). The families run
one after another, each with a quick profile measured just before it (with two threads
for the engine's two-thread family, with the stack's overhead terms for a stack family),
as `lamina up` predicts from a profile of the machine as it is: a shared machine's speed
moves by a quarter within minutes, and one profile set every prediction of a 45-minute
run. Each family is predicted from the fastest (by the batch-1 product's weight bytes per
second) of the profiles of its kind (threads, with or without the stack's terms)
measured so far in the run, the in-sample profile and its own included (--latest-profile:
its own): a neighbour slows a profile, never speeds it up, and one profile measured in a
slow stretch set a whole family 20-37% slow, where the cases, measured in passes over
minutes, count their fastest. Every prediction of a family is printed (and written to
--predictions) before any of its cases is measured; --one-profile makes every prediction
from the first profile before any case is measured. Each case is measured in --rounds
passes (3; a stack case's each its own stack, started and stopped), every member of its
family once a round in an order rotated each round, and its fastest pass counts (an
engine pass: its fastest step), as the profile keeps each kernel's fastest time; every
pass is printed with the CPU other processes took meanwhile. It reports their median and
largest error apart from the in-sample cases above, and, for each stack family, the
decision error: how much less the layout the planner ranks first measured than the best
measured one.

Prints the table and, last, one JSON line: {"cases", "median_abs_rel_error",
"max_abs_rel_error", ...} (with --out-of-sample also "out_of_sample": {...}).

--gpu ROWS --profile FILE measures nothing: it predicts each point of a GPU run of
bench/gpu_decode.py (its --out rows) from the device profile `lamina profile --device
cuda` wrote, the engine and the stack on the one GPU (`gpu_validation`), and prints
{"gpu": [...]} last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

# bench/'s own modules import by name (a script's folder is on its path).
from cpu_anchor import round_order

from lamina.planner.estimate import decode_step
from lamina.planner.gpu_layout import cuda_link
from lamina.planner.hardware import THIS_MACHINE, device_from_entry, load_catalogue
from lamina.planner.layouts import Layout
from lamina.planner.local_layout import host_layout, weights_precision
from lamina.planner.measure.engine_step import decode_step_cpu, decode_step_wall
from lamina.planner.measure.host_load import ForeignCpu
from lamina.planner.measure.stack_run import make_prompts, run_stack
from lamina.planner.perf.quantization import FP32
from lamina.planner.profile import profile
from lamina.planner.shapes import BUILTIN

# Batch x prompt stays within one prefill step of the engine, so the timed steps are pure decode.
CASES = ((1, 32), (1, 512), (4, 128), (4, 512), (8, 64), (8, 256), (16, 128), (32, 64))


@dataclass(frozen=True)
class Case:
    """One out-of-sample point: the engine (colocated, in one process) or the stack as
    `lamina up` starts it; the planner's choice is among the cases of one family."""

    family: str
    model: str | None  # None: SmolLM2-135M-Instruct; else a random:NAME model
    kind: str  # "engine" | "stack"
    batch: int
    prompt: int
    threads: int = 1
    layout: str = "colocated"  # stack: colocated | disaggregated
    attention_workers: int = 0
    micro_batches: int = 1
    weights: str = "float32"  # stack: model.weights

    def name(self) -> str:
        threads = f"{self.threads} thread{'s' * (self.threads > 1)}"
        where = (f"engine, {threads}" if self.kind == "engine" else
                 f"stack colocated, {threads}" if self.layout == "colocated" else
                 f"stack {self.attention_workers} attention, {self.micro_batches} micro-batch")
        weights = f", weights {self.weights}" if self.weights != "float32" else ""
        return f"{self.model or 'smollm2-135m'}: {where}{weights}, batch {self.batch}, prompt {self.prompt}"


M360, M1700 = "random:smollm2-360m", "random:smollm2-1.7b"
_STACK_LAYOUTS = (("colocated", 0, 1), *(("disaggregated", a, m) for a in (1, 2) for m in (1, 2, 3)))
# None at the calibration points: the engine's overhead points are 16-token prompts at batch
# 1 and 16 (planner.profile.OVERHEAD_POINTS), the stack's run batch 8 x 64 tokens with one
# attention worker and one micro-batch (STACK_POINT); the profile's kernels are timed alone.
OUT_OF_SAMPLE = (
    *(Case("engine, 360M shape", M360, "engine", b, p) for b, p in ((1, 128), (4, 512), (16, 256), (2, 2048))),
    *(Case("engine, 1.7B shape", M1700, "engine", b, p) for b, p in ((1, 128), (4, 128))),
    *(Case("engine, long contexts", None, "engine", b, p) for b, p in ((1, 4096), (2, 2048), (24, 128))),
    *(Case("engine, 2 threads", None, "engine", b, p, threads=2) for b, p in ((1, 256), (8, 512), (32, 128))),
    *(Case("stack, 135M, batch 16 x 512", None, "stack", 16, 512, layout=lay, attention_workers=a, micro_batches=m)
      for lay, a, m in _STACK_LAYOUTS),
    *(Case("stack, 360M shape, batch 8 x 256", M360, "stack", 8, 256, layout=lay, attention_workers=a,
           micro_batches=m) for lay, a, m in (_STACK_LAYOUTS[0], ("disaggregated", 1, 1), ("disaggregated", 2, 2))),
    # lamina up's choice of a colocated model worker's threads, predicted from the one-thread
    # profile and its measured speedup on two (Device.linear_speedup).
    *(Case(f"stack colocated threads, batch {b} x {p}", None, "stack", b, p, threads=t)
      for b, p in ((4, 256), (16, 512)) for t in (1, 2)),
    # lamina up's choice of the weights precision: the GGUF file's own Q4_1 blocks or the same
    # values in float32, each predicted on its kernel's measured cost per weight.
    *(Case(f"stack colocated weights, batch {b} x {p}", None, "stack", b, p, weights=w)
      for b, p in ((4, 256), (32, 128)) for w in ("as_file", "float32")),
)
ENGINE_STEPS, STACK_STEPS = 5, 32
# Each case is measured this many times, alternating within its family; its fastest pass
# counts, as the profile keeps each kernel's fastest time (planner/measure/kernels.py).
ROUNDS = 3


def predict(case: Case, shapes: dict, catalogues: dict, formats: dict) -> tuple[float, str]:
    """The planner's decode tokens/s for `case` and its bottleneck (`formats`: each model's
    file_weight_formats, for its as_file weights)."""
    shape = shapes[case.model]
    if case.kind == "engine":  # on the profile measured with the case's threads
        catalogue = catalogues[case.threads]
        layout = Layout(THIS_MACHINE, 1, weights=FP32, kv=FP32)
        context = case.prompt + 1 + ENGINE_STEPS / 2
    else:  # as lamina up's ranking predicts it (colocated: attention_workers 0), on the one-thread profile
        catalogue = catalogues[1]
        weights = weights_precision(case.weights, formats[case.model])
        layout = host_layout(case.attention_workers, case.micro_batches, weights, case.threads)
        context = case.prompt + STACK_STEPS / 2
    step = decode_step(shape, layout, catalogue, case.batch, context)
    return case.batch / step.step_s, step.bottleneck


def measure(case: Case, models: dict) -> float:
    """Decode tokens/s of `case`, measured now."""
    import torch

    from lamina.model.loader import load_model
    from lamina.model.quant import set_kernel_threads

    if case.model not in models:
        models.clear()  # one model in memory at a time (the 1.7B shape's weights are 6.8 GB)
        gc.collect()
        models[case.model] = load_model(case.model, weights="float32")
    loaded = models[case.model]
    if case.kind == "engine":
        torch.set_num_threads(case.threads)
        set_kernel_threads(case.threads)
        # Several threads: wall time (their CPU time adds up); one: CPU time, as the in-sample cases.
        timed = decode_step_wall if case.threads > 1 else decode_step_cpu
        return case.batch / timed(loaded, case.batch, case.prompt, ENGINE_STEPS, seed=case.batch * 1000 + case.prompt)
    prompts = make_prompts(loaded.tokenizer, case.batch, case.prompt)
    kv_bytes = 2 * case.batch * (case.prompt + STACK_STEPS + 64) * loaded.config.kv_bytes_per_token() + (256 << 20)
    return run_stack(prompts, STACK_STEPS, "tcp", case.micro_batches, False, 1, kv_bytes, case.weights,
                     attention_workers=max(1, case.attention_workers), layout=case.layout, model=case.model,
                     model_threads=case.threads)["tok_s"]


def schedule(cases: list[Case], rounds: int) -> list[int]:
    """The order in which `measure_all` measures `cases` (indices, each `rounds` times):
    family by family, each family in rounds, every member once a round in an order rotated
    each round (cpu_anchor.round_order), so that a slow stretch of a shared machine falls
    on several cases of a family, not on one (and a family's model is loaded once)."""
    order = []
    for family in dict.fromkeys(c.family for c in cases):
        members = [i for i, c in enumerate(cases) if c.family == family]
        order += [members[j] for r in range(rounds) for j in round_order(len(members), r)]
    return order


def measure_all(cases: list[Case], rounds: int, models: dict | None = None) -> list[list[dict]]:
    """Every case's `rounds` passes in `schedule`'s order, each {"tok_s", "foreign_cores"}
    (a stack case's each its own stack, started and stopped; `models`: loaded models kept
    between calls)."""
    passes: list[list[dict]] = [[] for _ in cases]
    models = {} if models is None else models
    order = schedule(cases, rounds)
    for n, i in enumerate(order, 1):
        others = ForeignCpu()
        tok_s = measure(cases[i], models)
        passes[i].append({"tok_s": tok_s, "foreign_cores": others.cores()})
        print(f"  [{n}/{len(order)} {time.strftime('%H:%M:%S')}] {cases[i].name()}: {tok_s:.1f} tok/s "
              f"(other processes {passes[i][-1]['foreign_cores']:.2f} cores)", flush=True)
    return passes


# --stack: the stack as `lamina up` starts it, at a point the profile's stack run (8 x 64
# tokens, 1 attention worker, 1 micro-batch) did not calibrate.
STACK_CASES = tuple(Case("stack, batch 32 x 256", None, "stack", 32, 256, layout="disaggregated", attention_workers=a,
                         micro_batches=m) for a in (1, 2) for m in (1, 2))


def stack_cases(catalogue: dict, rounds: int) -> list[dict]:
    """STACK_CASES measured in `rounds` passes, alternating (measure_all; each pass its own
    stack), the fastest counting, against the planner's prediction on `catalogue` (the
    in-sample profile, with the stack's overhead terms) as `lamina up` ranks layouts."""
    cases = list(STACK_CASES)
    guesses = [predict(c, {None: BUILTIN["smollm2-135m"]}, {1: catalogue}, {None: {}}) for c in cases]
    rows = []
    for case, (predicted, bottleneck), passes in zip(cases, guesses, measure_all(cases, rounds)):
        measured = max(p["tok_s"] for p in passes)
        err = (predicted - measured) / measured
        rows.append({"stack_micro_batches": case.micro_batches, "attention_workers": case.attention_workers,
                     "batch": case.batch, "prompt": case.prompt, "measured_tok_s": round(measured, 1),
                     "predicted_tok_s": round(predicted, 1), "rel_error": round(err, 3), "bottleneck": bottleneck,
                     "passes": passes})
        print(f"{case.name()}: measured {measured:.1f} tok/s (fastest of {len(passes)}), predicted "
              f"{predicted:.1f} tok/s, {err:+.1%}  {bottleneck}", flush=True)
    return rows


def profile_needs(members: list[Case]) -> tuple[int, bool]:
    """The profile a family's predictions are made from: its threads (the engine's
    two-thread cases are predicted on a profile measured with two; the stack's on the
    one-thread profile and its measured speedup, as `lamina up` ranks them) and whether it
    needs the stack's overhead terms (a stack case)."""
    threads = max((c.threads for c in members if c.kind == "engine"), default=1)
    return threads, any(c.kind == "stack" for c in members)


def catalogue_of(prof: dict) -> dict:
    catalogue = dict(load_catalogue())
    catalogue[THIS_MACHINE] = device_from_entry(THIS_MACHINE, prof["device"])
    return catalogue


def batch1_speed(prof: dict) -> float:
    """A profile's weight bytes per second in the batch-1 product: the kernel a slow
    stretch of a shared machine slows most plainly."""
    return prof["measurements"]["linear"]["1"]["weight_bytes_s"]


def predicting_profile(earlier: list[tuple[str, dict]], latest: bool = False) -> tuple[str, dict]:
    """Of the (family, profile) pairs of one kind measured so far, the family's own last,
    the one its predictions come from: the fastest (`latest`: its own)."""
    return earlier[-1] if latest else max(earlier, key=lambda e: batch1_speed(e[1]))


def profile_figures(prof: dict) -> dict:
    d = prof["device"]
    return {"memory_gb_s": round(d["memory_tb_s"]["value"] * 1e3, 2),
            "matmul_gflop_s": round(d["tflops"]["fp32"]["value"] * 1e3, 2),
            "foreign_cores": round(prof["measurements"]["foreign_cores"], 3)}


def out_of_sample(prof1: dict, predictions_path: Path | None, family: str | None = None,
                  rounds: int = ROUNDS, one_profile: bool = False, prof1_stack: bool = False,
                  latest_profile: bool = False) -> dict:
    """The OUT_OF_SAMPLE cases, family by family: a fresh profile (profile_needs), every
    prediction of the family printed and written down, then the family's measurements.
    A family is predicted from the fastest (batch1_speed) of the profiles of its kind
    (threads, with or without the stack's terms) measured so far in the run: its own,
    the earlier families', and `prof1` (one thread; `prof1_stack`: with the stack's
    terms); `latest_profile`: from its own. `one_profile`: every prediction first, from
    `prof1` and one two-thread profile, then every measurement. Errors and each stack
    family's decision error. `family`: only the families whose name holds it."""
    from lamina.model.checkpoints import checkpoint_name, file_weight_formats, load_config
    from lamina.planner.shapes import ModelShape

    cases = [c for c in OUT_OF_SAMPLE if family is None or family in c.family]
    shapes = {m: ModelShape.of(load_config(m), checkpoint_name(m)) for m in {c.model for c in cases}}
    formats = {m: file_weight_formats(m) for m in shapes}
    families = list(dict.fromkeys(c.family for c in cases))
    groups = [cases] if one_profile else [[c for c in cases if c.family == f] for f in families]
    predicted: list[tuple[float, str]] = []
    measured: list[list[dict]] = []
    profiles: list[dict] = []
    written: list[dict] = []
    models: dict = {}
    # By (threads, stack terms): the profiles measured so far, each with the family it was measured for.
    measured_profiles: dict[tuple[int, bool], list[tuple[str, dict]]] = {(1, prof1_stack): [("the in-sample cases",
                                                                                            prof1)]}
    for group in groups:
        if one_profile:
            print("out of sample: a profile with 2 threads (for the 2-thread cases)...", flush=True)
            prof2 = profile(threads=2, usd_per_hour=0.1, quick=True, stack=False)
            catalogues = {1: catalogue_of(prof1), 2: catalogue_of(prof2)}
            profiles.append({"family": None, "threads": 2, **profile_figures(prof2)})
        else:
            threads, stack = profile_needs(group)
            models.clear()  # the profile's own runs get the memory
            gc.collect()
            print(f"\n{group[0].family}: a profile with {threads} thread(s){' and the stack' * stack} "
                  f"({time.strftime('%H:%M:%S')})...", flush=True)
            prof = profile(threads=threads, usd_per_hour=0.1, quick=True, stack=stack)
            earlier = measured_profiles.setdefault((threads, stack), [])
            earlier.append((group[0].family, prof))
            source, chosen = predicting_profile(earlier, latest_profile)
            catalogues = {threads: catalogue_of(chosen)}
            profiles.append({"family": group[0].family, "threads": threads, **profile_figures(prof),
                             "batch1_gb_s": round(batch1_speed(prof) / 1e9, 2), "predicted_from": source})
            print(f"{group[0].family}: predicted from the profile measured for {source} (batch-1 product "
                  f"{batch1_speed(chosen) / 1e9:.2f} GB/s; this family's own: {batch1_speed(prof) / 1e9:.2f})",
                  flush=True)
        guesses = [predict(c, shapes, catalogues, formats) for c in group]
        print(f"\npredictions, written before their measurement ({time.strftime('%H:%M:%S')}):")
        for c, (tok_s, neck) in zip(group, guesses):
            print(f"  {c.family:<34} {c.name():<72} {tok_s:>9.1f} tok/s  {neck}")
        written += [{**asdict(c), "predicted_tok_s": p, "bottleneck": n,
                     "predicted_at": time.strftime("%Y-%m-%dT%H:%M:%S")} for c, (p, n) in zip(group, guesses)]
        if predictions_path is not None:
            predictions_path.write_text(json.dumps(written, indent=1) + "\n")
        predicted += guesses
        measured += measure_all(group, rounds, models)
    models.clear()
    print(f"\n{'case':<72} {'predicted':>10} {'measured':>10} {'error':>8}  (tok/s)", flush=True)
    rows = []
    for c, (tok_s, neck), passes in zip(cases, predicted, measured):
        got = max(p["tok_s"] for p in passes)
        err = (tok_s - got) / got
        rows.append({**asdict(c), "predicted_tok_s": round(tok_s, 2), "measured_tok_s": round(got, 2),
                     "rel_error": round(err, 3), "bottleneck": neck,
                     "passes_tok_s": [round(p["tok_s"], 2) for p in passes],
                     "foreign_cores": [round(p["foreign_cores"], 3) for p in passes]})
        each = ", ".join(f"{p['tok_s']:.1f}" for p in passes)
        spread = f"  (rounds: {each})" if len(passes) > 1 else ""
        print(f"{c.name():<72} {tok_s:>10.1f} {got:>10.1f} {err:>+8.1%}{spread}", flush=True)
    errors = [abs(r["rel_error"]) for r in rows]
    decisions = {}
    for family in dict.fromkeys(r["family"] for r in rows if r["kind"] == "stack"):
        members = [r for r in rows if r["family"] == family]
        first = max(members, key=lambda r: r["predicted_tok_s"])
        best = max(members, key=lambda r: r["measured_tok_s"])
        decisions[family] = {"planner_first": Case(**{k: first[k] for k in Case.__dataclass_fields__}).name(),
                             "best_measured": Case(**{k: best[k] for k in Case.__dataclass_fields__}).name(),
                             "decision_error": round(1 - first["measured_tok_s"] / best["measured_tok_s"], 3)}
    for family, d in decisions.items():
        print(f"{family}: the planner's first, {d['planner_first']}, measured {1 - d['decision_error']:.1%} of the "
              f"best, {d['best_measured']}")
    for p in profiles:
        source = f"; predicted from the one for {p['predicted_from']}" if p.get("predicted_from") else ""
        print(f"profile for {p['family'] or 'the 2-thread cases'} ({p['threads']} thread(s)): memory "
              f"{p['memory_gb_s']:.2f} GB/s, matmul {p['matmul_gflop_s']:.2f} GFLOP/s{source}")
    print(f"out of sample: {len(rows)} cases, median |error| {statistics.median(errors):.1%}, largest "
          f"{max(errors):.1%}", flush=True)
    return {"cases": len(rows), "median_abs_rel_error": round(statistics.median(errors), 3),
            "max_abs_rel_error": round(max(errors), 3), "decisions": decisions, "rows": rows,
            "profiles": profiles}


def gpu_validation(rows_path: Path, profile_path: Path, steps: int) -> list[dict]:
    """The planner's prediction of each point bench/gpu_decode.py measured (its --out
    rows), on the device profile `lamina profile --device D` wrote, against the measured
    tokens/s, weights and KV in the row's dtype, at the steps' mean context: the engine
    and the colocated stack (`stack_colocated_tok_s`) as a colocated layout on
    `this-machine`, and each disaggregated stack run (`stack_mb{N}_aw{n}_tok_s`: one
    model worker, n attention workers, N micro-batches, request partitioning) with every
    worker on that one device (`Layout.shared_device`), exchanging over cuda_ipc
    (`cuda_link`). Prints the table and the errors' median and largest; returns the rows."""
    from lamina.model.random_models import SHAPES
    from lamina.planner.perf.quantization import FP16
    from lamina.planner.shapes import ModelShape

    prof = json.loads(profile_path.read_text())
    catalogue = catalogue_of(prof)
    link = cuda_link(prof)
    if link is not None:
        catalogue[GPU_STACK] = replace(catalogue[THIS_MACHINE], name=GPU_STACK, network_bw=link[0],
                                       network_latency=link[1])
    print(f"device profile {profile_path}: {prof['device']['description']}; rows {rows_path}")
    print(f"{'point':<34} {'contender':<16} {'measured tok/s':>15} {'predicted tok/s':>16} {'rel error':>10}  "
          "bottleneck")
    out = []
    # A point's row is appended after each contender: its last one holds the most.
    last = {row["point"]: row for row in map(json.loads, rows_path.read_text().splitlines())}
    for row in last.values():
        model, dtype, batch, context = row["point"].split("/")
        batch_n, context_n = int(batch[1:]), int(context[1:])
        shape = BUILTIN["smollm2-135m"] if model == "smollm2" else ModelShape.of(SHAPES[model], model)
        precision = FP32 if dtype == "float32" else FP16
        mean_context = context_n + 1 + row.get("steps", steps) / 2
        colocated = Layout(THIS_MACHINE, 1, weights=precision, kv=precision)
        # The stack colocated on the device is predicted as the engine is (it has no link).
        contenders = [("engine", "engine_tok_s", colocated), ("stack colocated", "stack_colocated_tok_s", colocated)]
        if link is not None:
            contenders += [(f"stack mb{n} aw{a}", key, Layout(GPU_STACK, 1, 1, GPU_STACK, a, n, "request", precision,
                                                             precision, shared_device=True))
                           for key, n, a in stack_keys(row)]
        for contender, key, layout in contenders:
            if key not in row:
                continue  # a skipped point, or that contender failed there
            step = decode_step(shape, layout, catalogue, batch_n, mean_context)
            predicted, measured = batch_n / step.step_s, row[key]
            err = (predicted - measured) / measured
            out.append({"point": row["point"], "contender": contender, "measured_tok_s": measured,
                        "predicted_tok_s": predicted, "rel_error": err, "bottleneck": step.bottleneck})
            print(f"{row['point']:<34} {contender:<16} {measured:>15.1f} {predicted:>16.1f} {err:>+10.1%}  "
                  f"{step.bottleneck}")
    for contender in ("engine", "stack"):
        errors = [abs(r["rel_error"]) for r in out if r["contender"].startswith(contender)]
        if errors:
            print(f"{contender}: {len(errors)} points, median error {statistics.median(errors):.1%}, "
                  f"largest {max(errors):.1%}")
    if link is None and any(stack_keys(row) for row in last.values()):
        print("stack rows left out: the profile measured no cuda_ipc round trip (lamina profile --device on a GPU "
              "with cuda_ipc available does)")
    print(json.dumps({"gpu": out}))
    return out


# The catalogue name of the device profile's entry with cuda_ipc's figures for its link.
GPU_STACK = "this-machine (cuda_ipc)"


def stack_keys(row: dict) -> list[tuple[str, int, int]]:
    """(key, micro-batches, attention workers) of each stack figure in a gpu_decode row."""
    keys = []
    for key in row:
        match = re.fullmatch(r"stack_mb(\d+)_aw(\d+)_tok_s", key)
        if match:
            keys.append((key, int(match[1]), int(match[2])))
    return sorted(keys, key=lambda k: k[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", type=Path, default=None, metavar="ROWS",
                    help="compare the planner with bench/gpu_decode.py's rows (its --out file) on the device profile "
                         "--profile names (lamina profile --device D), then stop")
    ap.add_argument("--profile", type=Path, default=None, help="--gpu: the device profile")
    ap.add_argument("--gpu-steps", type=int, default=32, help="--gpu: the decode steps gpu_decode timed (default 32)")
    ap.add_argument("--quick", action="store_true", help="fewer steps per case (within 10 minutes)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps per case (default 12, 5 with --quick)")
    ap.add_argument("--stack", action="store_true",
                    help="also the stack at 1 and 2 micro-batches with 1 and 2 attention workers")
    ap.add_argument("--save-profile", type=Path, default=None, help="write the measured profile here (JSON)")
    ap.add_argument("--out-of-sample", action="store_true",
                    help=f"also the {len(OUT_OF_SAMPLE)} cases the calibration never touched (OUT_OF_SAMPLE; "
                         "about 45 minutes here with 3 rounds)")
    ap.add_argument("--predictions", type=Path, default=None,
                    help="--out-of-sample: write its predictions here (JSON) before measuring any")
    ap.add_argument("--family", default=None, help="--out-of-sample: only the families whose name holds this")
    ap.add_argument("--rounds", type=int, default=ROUNDS,
                    help=f"--stack and --out-of-sample: passes of each case, alternating within its family; the "
                         f"fastest counts (default {ROUNDS})")
    ap.add_argument("--latest-profile", action="store_true",
                    help="--out-of-sample: predict each family from the profile measured just before it, not the "
                         "fastest of its kind measured so far")
    ap.add_argument("--one-profile", action="store_true",
                    help="--out-of-sample: predict every case from the first profile (and one with 2 threads) "
                         "before measuring any, instead of each family from a profile measured just before it")
    args = ap.parse_args()
    if args.gpu is not None:
        if args.profile is None:
            ap.error("--gpu needs --profile (lamina profile --device D writes it)")
        gpu_validation(args.gpu, args.profile, args.gpu_steps)
        return
    steps = args.steps or (5 if args.quick else 12)

    import torch

    from lamina.model.loader import load_model

    prof1_stack = args.stack or (args.out_of_sample and args.one_profile)
    prof = profile(threads=1, usd_per_hour=0.1, quick=args.quick, stack=prof1_stack)
    if args.save_profile:
        args.save_profile.write_text(json.dumps(prof, indent=2) + "\n")
    catalogue = catalogue_of(prof)
    torch.set_num_threads(1)
    loaded = load_model()
    shape = BUILTIN["smollm2-135m"]
    layout = Layout(THIS_MACHINE, 1, weights=FP32, kv=FP32)
    rows = []
    print(f"{'batch':>5} {'prompt':>6} {'measured ms':>12} {'predicted ms':>13} {'rel error':>10}  bottleneck")
    for batch, prompt in CASES:
        measured = decode_step_cpu(loaded, batch, prompt, steps, seed=batch * 1000 + prompt)
        # The steps run at contexts prompt + 1 ... prompt + steps: their middle.
        predicted = decode_step(shape, layout, catalogue, batch, prompt + 1 + steps / 2)
        err = (predicted.step_s - measured) / measured
        rows.append({"batch": batch, "prompt": prompt, "measured_ms": round(measured * 1e3, 2),
                     "predicted_ms": round(predicted.step_s * 1e3, 2), "rel_error": round(err, 3),
                     "bottleneck": predicted.bottleneck})
        print(f"{batch:>5} {prompt:>6} {measured * 1e3:>12.2f} {predicted.step_s * 1e3:>13.2f} {err:>+10.1%}  "
              f"{predicted.bottleneck}")
    del loaded
    if args.stack:
        rows += stack_cases(catalogue, args.rounds)
    oos = (out_of_sample(prof, args.predictions, args.family, args.rounds, args.one_profile, prof1_stack,
                         args.latest_profile) if args.out_of_sample else None)
    errors = [abs(r["rel_error"]) for r in rows]
    d = prof["device"]
    print(f"profile: memory {d['memory_tb_s']['value'] * 1e3:.2f} GB/s, "
          f"matmul {d['tflops']['fp32']['value'] * 1e3:.2f} GFLOP/s, "
          f"attention {d['attention_tb_s']['value'] * 1e3:.2f} GB/s of KV (1 thread); "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if "slice_overhead_us" in d:
        print(f"stack overheads per layer: slice {d['slice_overhead_us']['value']:.0f} us, frame "
              f"{d['frame_overhead_us']['value']:.0f} us, exchange {d['exchange_overhead_us']['value']:.0f} us "
              f"(TCP round trip {2 * d['network_latency_us']['value']:.0f} us)")
    print(json.dumps({"cases": len(rows), "median_abs_rel_error": round(statistics.median(errors), 3),
                      "max_abs_rel_error": round(max(errors), 3), "rows": rows,
                      "load_avg_1min": round(os.getloadavg()[0], 2),
                      "profile": profile_figures(prof),
                      **({"out_of_sample": oos} if oos is not None else {})}))


if __name__ == "__main__":
    main()
