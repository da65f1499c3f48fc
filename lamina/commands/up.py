"""`lamina up`: the whole stack (embedded Redis and every service) from one command, as
child processes of this one, or, with `--ray ADDRESS`, as actors on a Ray cluster's nodes."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from lamina.commands._service_args import (
    add_common,
    add_gateway_exposure,
    add_kv_quant,
    devices_here,
    gateway_refused,
    model_readable,
    stack_config,
)
from lamina.commands.plan import DEFAULT_PROFILE
from lamina.services.config import DTYPE_SETTINGS, ConfigError, canonical_device, set_outside_defaults

# How often lamina up looks for a stop signal and at its processes.
STOP_POLL_S = 0.5

# Settings that name a layout, or that only the disaggregated one takes: set anywhere, they
# leave --layout auto out.
LAYOUT_SETTINGS = ("layout", "attention.workers", "attention.max_workers", "pipeline.micro_batches",
                   "pipeline.mode", "partition")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p)
    p.add_argument("--port", type=int, default=None, help="HTTP port of the OpenAI API (default 8000)")
    p.add_argument("--attention-workers", type=int, default=None, help="number of attention workers (default 2)")
    p.add_argument("--attention-max-workers", type=int, default=None,
                   help="attention workers that may join the running stack, up to this many in all (default 0: "
                        "a fixed pool; request partitioning; docs/deploy.md)")
    p.add_argument("--layout", default=None, choices=("auto", "disaggregated", "colocated"),
                   help="auto (the default where nothing names a layout: none of --layout, --attention-workers, "
                        "--attention-max-workers, --micro-batches, --pipeline, --partition, --ray, nor those "
                        "settings in the configuration or environment): the layout the planner predicts fastest on "
                        "this machine's profile, measured once, or with the services on a GPU on that GPU's "
                        "figures (docs/services.md, Layouts); disaggregated: "
                        "attention workers in processes of their own; colocated: each model worker attends in "
                        "its own process, no attention workers (layout)")
    p.add_argument("--workload", default=None, metavar="CONCURRENCY,PROMPT,OUTPUT | PROMPT,OUTPUT@RATE | TRACE",
                   help="the serving load --layout auto ranks the layouts for: requests at once, prompt and output "
                        "tokens each (default 8,512,256); or prompt and output tokens of requests arriving at RATE "
                        "a second; or a trace file (Azure CSV, Kimi JSONL: its mean lengths and rate). With a "
                        "rate, the layouts that keep up rank by time per token")
    p.add_argument("--profile", type=Path, default=DEFAULT_PROFILE, metavar="PATH",
                   help=f"this machine's profile for --layout auto (default {DEFAULT_PROFILE}; measured there by "
                        "`lamina profile --quick` when missing, from another machine or another version; with "
                        "the services on a GPU, the profile-cudaN.json `lamina profile --device` wrote beside it)")
    p.add_argument("--model-workers", type=int, default=None, help="number of model-slice workers (default 1)")
    p.add_argument("--model-threads", type=int, default=None,
                   help="threads of each model worker's packed products and attention; torch's ops run on one "
                        "(default 1, or, where --layout auto chooses colocated, the thread count its planner ranks "
                        "first, within the host's cores shared among the model workers; docs/services.md, Layouts)")
    p.add_argument("--prefill-workers", type=int, default=None,
                   help="number of prefill workers, each with its own prefix cache (default 1)")
    p.add_argument("--prefill-routing", default=None, choices=("prefix", "round_robin"),
                   help="prefix: send each prompt to the prefill worker holding the most of it, unless its "
                        "queue is far longer than another's (default); round_robin: each worker in turn")
    p.add_argument("--prefill-device", default=None, metavar="DEVICE",
                   help="where prefill workers compute and keep their prefix cache's device tier: cpu "
                        "(default), cuda or cuda:N (float32 weights there; docs/kvstore.md)")
    p.add_argument("--device", default=None, metavar="DEVICE",
                   help="where every service computes: cpu (default), cuda or cuda:N; --prefill-device, "
                        "--model-device and --attention-device override it for one kind (docs/services.md, Devices)")
    p.add_argument("--model-device", default=None, metavar="DEVICE", help="where model workers compute")
    p.add_argument("--attention-device", default=None, metavar="DEVICE",
                   help="where attention workers keep KV and attend")
    p.add_argument("--dtype", default=None, choices=DTYPE_SETTINGS,
                   help="prefill, model and attention workers' dtype (default auto: float32 on the CPU, bfloat16 "
                        "on a GPU; another than float32 needs --weights float32 on the CPU)")
    p.add_argument("--micro-batches", type=int, default=None,
                   help="staggered micro-batches per model worker (default 2; 1 turns staggering off)")
    p.add_argument("--pipeline", default=None, choices=("fixed", "rotational"),
                   help="fixed: each model worker keeps its micro-batches (default); rotational: M + 1 "
                        "micro-batches move to whichever of the M model workers is free, slice by slice")
    p.add_argument("--q-early", action=argparse.BooleanOptionalAction, default=None,
                   help="send Q before K, V and combine partial attention (default off)")
    p.add_argument("--weights", default=None, choices=("float32", "q8_0", "q4", "as_file"),
                   help="how model and prefill workers hold the linears (default as_file; docs/model.md)")
    add_kv_quant(p)
    add_gateway_exposure(p)
    p.add_argument("--log-dir", type=Path, default=None, metavar="DIR",
                   help="write each service's log to DIR/<service>.log (made if missing; default: a new private "
                        "directory under the system's temporary directory); the logs stay after the stack stops")
    p.add_argument("--supervise", action=argparse.BooleanOptionalAction, default=True,
                   help="restart a service process that exits, with backoff (default on; with --no-supervise "
                        "any exit stops the stack)")
    p.add_argument("--ray", metavar="ADDRESS", default=None,
                   help="run every service (and the embedded Redis) as a Ray actor on the cluster at ADDRESS (its "
                        "head's host:port, or auto), each kind on the nodes that declare its custom resource; needs "
                        "the ray extra (docs/deploy.md, Ray)")
    p.add_argument("--ray-resource", metavar="KIND=NAME", action="append", default=[],
                   help="the custom Ray resource each actor of KIND asks one unit of (repeatable; an empty NAME: "
                        "none, any node). Defaults: model=model_worker, prefill=prefill_worker, "
                        "attention=attention_worker; redis, scheduler and gateway ask none")


def run(args: argparse.Namespace) -> int:
    if args.ray_resource and not args.ray:  # before the machine is measured for --layout auto
        print("lamina up: --ray-resource needs --ray", file=sys.stderr)
        return 2
    if args.layout == "colocated" and (args.attention_workers or args.attention_max_workers):
        print("lamina up: --layout colocated has no attention workers of its own (each model worker holds its "
              "sequences' KV): set --model-workers instead of --attention-workers / --attention-max-workers",
              file=sys.stderr)
        return 2
    overrides: dict[str, object] = {"layout": args.layout, "gateway.port": args.port,
                                    "attention.workers": args.attention_workers,
                                    "attention.max_workers": args.attention_max_workers,
                                    "model_worker.workers": args.model_workers,
                                    "model_worker.threads": args.model_threads,
                                    "prefill.workers": args.prefill_workers, "prefill.routing": args.prefill_routing,
                                    "prefill.device": args.prefill_device or args.device,
                                    "model_worker.device": args.model_device or args.device,
                                    "attention.device": args.attention_device or args.device,
                                    "model_worker.dtype": args.dtype, "attention.dtype": args.dtype,
                                    "prefill.dtype": args.dtype,
                                    "pipeline.micro_batches": args.micro_batches, "pipeline.q_early": args.q_early,
                                    "pipeline.mode": args.pipeline,
                                    "weights": args.weights, "attention.kv_quant": args.kv_quant,
                                    "gateway.api_key": args.api_key,
                                    "gateway.insecure": args.insecure}
    auto = _auto_layout(args)
    if auto is None:
        return 2
    if auto:
        overrides["layout"] = None  # "auto" is lamina up's, not a layout the services know
    config = stack_config(args, **overrides)
    if config is None or gateway_refused(config):
        return 2
    if args.ray is None:  # before the machine is measured for --layout auto
        from lamina.services.launch.launcher import gateway_port_taken

        taken = gateway_port_taken(config)
        if taken is not None:
            print(f"lamina up: {taken}", file=sys.stderr)
            return 2
    if args.ray is None and not devices_here(config, ("prefill", "model_worker", "attention")):
        return 2  # before anything starts (under Ray each service checks on its own node)
    if args.ray is None and not model_readable(config.model, "up"):
        return 2  # a GGUF file converted once, here, not by each service at once
    try:
        gpu_transport, why = transport_on_gpus(args, config)
    except ConfigError as exc:
        print(f"lamina: {exc}", file=sys.stderr)
        return 2
    if why:
        print(f"lamina up: {why}", file=sys.stderr, flush=True)
    if gpu_transport:
        overrides["transport"] = gpu_transport
        config = stack_config(args, **overrides)
        if config is None:
            return 2
    if args.ray is None:  # every layout's prefill workers send KV over it
        from lamina.transports.registry import availability

        missing = availability(config.transport)
        if missing is not None:
            print(f"lamina up: transport {config.transport} cannot run here: {missing}", file=sys.stderr)
            return 2
    if config.ports.grpc or config.ports.metrics:  # every service of this stack shares the host
        print("lamina up: ports.grpc and ports.metrics must be 0 (one service per host only; "
              "LAMINA_GRPC_PORT / LAMINA_METRICS_PORT set?)", file=sys.stderr)
        return 2
    if auto:  # only a configuration that can start is worth measuring the machine for
        try:
            weights_set = args.weights is not None or bool(set_outside_defaults(args.config, ("weights",)))
        except ConfigError as exc:
            print(f"lamina: {exc}", file=sys.stderr)
            return 2
        choice = choose_layout(config, args.workload, args.profile, weights_set)
        if choice is None:
            return 2
        chosen = {**overrides, **choice.overrides()}
        threads = _auto_threads(args, choice, config.model_worker.workers)
        if threads is None:
            return 2
        if threads:
            chosen["model_worker.threads"] = threads
            print(f"lamina up: layout auto: {threads} compute thread(s) per model worker (colocated: the "
                  f"planner's choice within the host's cores; --model-threads sets them)", file=sys.stderr, flush=True)
        config = stack_config(args, **chosen)
        if config is None:
            return 2
    from lamina.services.launch.launcher import Stack
    from lamina.services.launch.supervision import describe_exit

    if args.ray is None:
        from lamina.services.kv_budget import with_kv_budget

        try:  # a GPU whose memory leaves no KV room: said once, before anything starts
            config, budget = with_kv_budget(config)
        except ConfigError as exc:
            print(f"lamina: {exc}", file=sys.stderr)
            return 2
        if budget is not None:
            print(f"lamina up: KV {budget.per_holder / (1 << 30):.1f} GiB per attention core ({budget.why})",
                  file=sys.stderr, flush=True)
    if args.ray:
        stack = _ray_stack(args, config)
        if stack is None:
            return 2
        where = f"as actors of the Ray cluster at {args.ray}, each service's log on its node"
    else:
        try:  # its logs outlive it: "logs in"
            log_dir = None if args.log_dir is None else args.log_dir.absolute()  # "logs in" names it whole
            stack = Stack(config, log_dir=log_dir, supervise=args.supervise, keep_logs=True)
        except OSError as exc:  # a --log-dir that cannot be made
            print(f"lamina up: --log-dir: {exc}", file=sys.stderr)
            return 2
        where = f"logs in {stack.log_dir}"
    # The handler only appends: it runs in the main thread between two bytecodes, also
    # inside a wait that holds a lock (an Event.set() there took that lock again and
    # hung lamina up on Ctrl-C).
    stop_signals: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stop_signals.append(signum))
    mode = " in all, rotational" if config.rotational else ""
    print(f"starting: {config.model_worker.workers} model worker(s) with {config.decode_micro_batches} "
          f"micro-batch(es){mode}{' and Q sent early' if config.pipeline.q_early else ''}, "
          f"{_attention(config)}, {config.prefill.workers} prefill worker(s), "
          f"transport {config.transport}, "
          f"{config.partition}-level partitioning; {where}", file=sys.stderr)
    try:
        stack.start()
    except (RuntimeError, TimeoutError) as exc:
        print(f"lamina up: {exc}", file=sys.stderr)
        return 1
    print(f"Lamina is serving the OpenAI API at {stack.base_url}/v1 (Ctrl-C to stop)", flush=True)
    try:
        while not stop_signals:
            time.sleep(STOP_POLL_S)
            # Supervised, a process that exits is restarted; the stack stops only when the
            # supervisor gives up on one (it keeps crashing).
            if stack.given_up is not None:
                name = stack.given_up.process.name
                print(f"lamina up: {name} keeps exiting ({stack.given_up.reason}); stopping.\n"
                      f"{stack.log_tail(name)}", file=sys.stderr)
                return 1
            dead = None if args.supervise else stack.dead_process()
            if dead is not None:
                print(f"lamina up: {dead.name} exited ({describe_exit(dead.proc.returncode)}); stopping.\n"
                      f"{stack.log_tail(dead.name)}", file=sys.stderr)
                return 1
    finally:
        print("stopping...", file=sys.stderr)
        stack.stop()
    return 0


def all_on_gpus(config) -> bool:
    """Whether prefill, model and attention workers all compute on GPUs: on one host, where
    the cuda_ipc transport carries their tensors in device memory. Over TCP (the
    configuration's default) each frame of CUDA tensors is staged through host memory on
    both sides: a 2,048-token prompt's KV of an 8B model in bfloat16 is 256 MiB, some
    50 ms at the 5-6 GB/s of loopback TCP measured here (docs/transports.md), about what
    an H200 takes to compute that prompt's prefill."""
    devices = (config.prefill.device, config.model_worker.device, config.attention.device)
    return all(canonical_device(d).startswith("cuda:") for d in devices)


def transport_on_gpus(args: argparse.Namespace, config) -> tuple[str | None, str]:
    """The transport lamina up takes for a stack whose prefill, model and attention
    workers all compute on GPUs of this host, where nothing names one (--transport,
    LAMINA_TRANSPORT, the configuration file) and not under Ray (whose services may be on
    several hosts): cuda_ipc where it can run here, else none (the configured TCP); and
    the line that says so ("" where no such stack). Raises ConfigError where the file
    cannot be read."""
    if args.ray is not None or args.transport is not None or config.transport == "cuda_ipc":
        return None, ""
    if not all_on_gpus(config) or set_outside_defaults(args.config, ("transport",)):
        return None, ""
    from lamina.transports.registry import availability

    missing = availability("cuda_ipc")
    if missing is not None:
        return None, (f"transport {config.transport}: cuda_ipc, which keeps a GPU stack's tensors in device "
                      f"memory, cannot run here ({missing})")
    return "cuda_ipc", ("transport cuda_ipc (prefill, model and attention workers all compute on GPUs of this "
                        "host: prompt KV and layer tensors stay in device memory; --transport names another)")


def _auto_layout(args: argparse.Namespace) -> bool | None:
    """Whether the layout is to be chosen by measurement (None after printing why the
    request cannot be served): asked for, or no layout named anywhere."""
    if args.layout == "auto":
        if args.ray:
            print("lamina up: --layout auto ranks the layouts of this machine; under --ray name one", file=sys.stderr)
            return None
        return True
    # A flag or setting that only one layout takes names that one.
    named = (args.layout, args.ray, args.attention_workers, args.attention_max_workers, args.micro_batches,
             args.pipeline, args.partition)
    if any(value is not None for value in named):
        return False
    try:
        return not set_outside_defaults(args.config, LAYOUT_SETTINGS)
    except ConfigError as exc:
        print(f"lamina: {exc}", file=sys.stderr)
        return None


def _auto_threads(args: argparse.Namespace, choice, model_workers: int) -> int | None:
    """The model workers' threads for the layout auto chose (lamina.planner.local_layout.
    auto_model_threads: colocated, the thread count the planner ranked first), 0 where they
    are set anywhere (flag, configuration, environment) or the layout keeps the default;
    None after printing why the configuration is unreadable."""
    from lamina.planner.local_layout import auto_model_threads

    if args.model_threads is not None:
        return 0
    try:
        if set_outside_defaults(args.config, ("model_worker.threads",)):
            return 0
    except ConfigError as exc:
        print(f"lamina: {exc}", file=sys.stderr)
        return None
    return auto_model_threads(choice, len(os.sched_getaffinity(0)), model_workers) or 0


def choose_layout(config, workload: str | None, profile_path: Path, weights_set: bool = False):
    """The layout the planner ranks first for `config`'s model on this machine's profile
    (measured into `profile_path` when it holds none for this machine and version), with
    `config`'s weights where `weights_set`, else with the weights precision it ranks first
    among those that keep the checkpoint's values; prints the three best with their
    predicted tokens/s. Model or attention workers on a GPU: `_choose_on_gpu`, which
    neither reads nor measures the host's profile. None after printing why there is no
    choice."""
    from lamina.model.checkpoints import checkpoint_name, file_weight_formats, load_config
    from lamina.planner.local_layout import (
        LocalWorkload,
        lossless_weights,
        machine_profile,
        rank_layouts,
        weights_precision,
    )
    from lamina.planner.profile import profile
    from lamina.planner.shapes import ModelShape

    try:
        load = LocalWorkload.parse(workload) if workload else LocalWorkload()
    except ValueError as exc:
        print(f"lamina up: {exc}", file=sys.stderr)
        return None
    # No more decode at once than the scheduler admits.
    load = dataclasses.replace(load, concurrency=min(load.concurrency, config.scheduler.max_batch_size))
    say = lambda line: print(f"lamina up: {line}", file=sys.stderr, flush=True)  # noqa: E731
    if config.model_worker.device != "cpu" or config.attention.device != "cpu":
        return _choose_on_gpu(config, load, profile_path, say)
    measured = machine_profile(profile_path, lambda: profile(1, 0.1, quick=True), say)
    shape = ModelShape.of(load_config(config.model), checkpoint_name(config.model))
    ranked_here = not weights_set
    # Only as_file's precision depends on the file's blocks; reading them repacks a GGUF
    # file's blocks the first time, which set float weights never need.
    formats = file_weight_formats(config.model) if ranked_here or config.weights == "as_file" else {}
    names = lossless_weights(formats) if ranked_here else (config.weights,)
    ranked = rank_layouts(measured["device"], shape, {w: weights_precision(w, formats) for w in names}, load)
    best = ranked[0]
    say(f"layout auto: {best.describe()}; predicted for {load.describe()}: "
        + "; ".join(f"{c.describe()} {c.predicted()}" for c in ranked[:3])
        + f" (profile {profile_path}; `lamina profile` re-measures, --layout names one)")
    return best


def _choose_on_gpu(config, load, profile_path: Path, say: Callable[[str], None]):
    """choose_layout where model or attention workers compute on a GPU: on one GPU, the
    layout the planner ranks first on that GPU's figures (lamina.planner.gpu_layout);
    with the two on different devices, disaggregated (attention workers of their own
    there), as configured."""
    import torch

    from lamina.model.checkpoints import checkpoint_name, load_config
    from lamina.planner.gpu_layout import device_profile_paths, gpu_figures, rank_gpu_layouts
    from lamina.planner.local_layout import LocalChoice
    from lamina.planner.perf.quantization import FP16, FP32
    from lamina.planner.shapes import ModelShape

    model, attention = (canonical_device(config.model_worker.device), canonical_device(config.attention.device))
    if model != attention:
        choice = LocalChoice("disaggregated", config.attention.workers, config.pipeline.micro_batches, 0.0, "")
        say(f"layout auto: {choice.describe()} (model workers on {model}, attention workers on {attention}: "
            "the layout that computes attention there; --layout names one)")
        return choice
    gpu = torch.cuda.get_device_name(torch.device(model))
    figures = gpu_figures(gpu, device_profile_paths(profile_path, model))
    if figures is None:
        say(f"layout auto: colocated on {model} (the {gpu} has no device profile, `lamina profile --device "
            f"{model}`, and no catalogue entry; on one GPU the planner ranks colocated first on every GPU it "
            "knows, docs/planner.md; --layout names one)")
        return LocalChoice("colocated", 0, 1, 0.0, "", device=model)
    shape = ModelShape.of(load_config(config.model), checkpoint_name(config.model))
    precision = {"float32": FP32}
    ranked = rank_gpu_layouts(figures, shape, precision.get(config.model_worker.compute_dtype, FP16),
                              precision.get(config.attention.compute_dtype, FP16), load, model)
    best = ranked[0]
    say(f"layout auto: {best.describe()}; predicted for {load.describe()}: "
        + "; ".join(f"{c.describe()} {c.predicted()}" for c in ranked[:3])
        + f" ({gpu}: {figures.source}; `lamina profile --device {model}` measures it, --layout names one)")
    if best.layout == "disaggregated" and config.transport != "cuda_ipc":
        say(f"layout auto: the split was predicted over cuda_ipc; this stack's transport is {config.transport} "
            "(--transport cuda_ipc serves as predicted)")
    return best


def _attention(config) -> str:
    if config.colocated:
        return "attention in each model worker (layout colocated)"
    return f"{config.attention.workers} attention workers"


def _ray_stack(args: argparse.Namespace, config):
    """The RayStack of `--ray`, or None after printing why there is none."""
    import importlib.util

    from lamina.services.launch.ray_placement import parse_placement

    try:
        placement = parse_placement(args.ray_resource)
    except ValueError as exc:
        print(f"lamina up: {exc}", file=sys.stderr)
        return None
    if importlib.util.find_spec("ray") is None:
        print("lamina up: --ray needs the ray package (pip install -e '.[ray]')", file=sys.stderr)
        return None
    from lamina.services.launch.ray_stack import RayStack

    return RayStack(config, args.ray, placement, supervise=args.supervise)
