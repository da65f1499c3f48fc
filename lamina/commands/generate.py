"""`lamina generate`: one prompt through the local engine."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from lamina.model.packing import WEIGHT_CHOICES
from lamina.services.config import DTYPE_SETTINGS, resolve_dtype


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True, help="the prompt text (the user message with --chat)")
    p.add_argument("--chat", action="store_true", help="apply the checkpoint's chat template")
    p.add_argument("--model", default=None, help="checkpoint directory, .gguf file or random:SHAPE[@SEED] "
                   "(default: SmolLM2-135M-Instruct)")
    p.add_argument("--weights", default="as_file", choices=WEIGHT_CHOICES,
                   help="how the linears hold their weights: float32, q8_0, q4 (group-wise 4-bit) or as_file "
                        "(a GGUF's own quantized blocks, float32 for other checkpoints); default as_file")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N: where the engine computes")
    p.add_argument("--dtype", default="auto", choices=DTYPE_SETTINGS,
                   help="weights, activations and KV (default auto: float32 on the CPU, bfloat16 on a GPU; another "
                        "than float32, or a device other than the CPU, uses torch's own linears instead of packed "
                        "weights: --weights float32)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="on a GPU, replay each decode step as a CUDA graph, whole where triton is installed, "
                        "else slice by slice (default; --no-cuda-graphs: everything eagerly)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--threads", type=int, default=None,
                   help="threads of the packed products; torch's own ops run on one (default: the cores "
                        "this process may run on)")
    p.add_argument("--json", action="store_true", help='print {"text", "token_ids"} as the last line')


def run(args: argparse.Namespace) -> int:
    from lamina.engine import Engine, EngineConfig, SamplingParams
    from lamina.model.checkpoints import pending_write
    from lamina.model.errors import CheckpointError
    from lamina.model.loader import load_model
    from lamina.model.placement import runs_natively
    from lamina.services.config import ConfigError
    from lamina.services.devices import compute_dtype, open_device

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
        )
    except ValueError as exc:
        print(f"lamina generate: {exc}", file=sys.stderr)
        return 2
    threads = args.threads if args.threads is not None else len(os.sched_getaffinity(0))
    if threads < 1:
        print("lamina generate: --threads must be at least 1", file=sys.stderr)
        return 2
    from lamina.model.threads import set_compute_threads

    set_compute_threads(threads)
    try:
        device = open_device("--device", args.device)
    except (ConfigError, RuntimeError) as exc:  # RuntimeError: a device name torch does not know
        print(f"lamina generate: {exc}", file=sys.stderr)
        return 2
    dtype = resolve_dtype(args.dtype, args.device)
    native = runs_natively(device, compute_dtype(dtype))
    if not native and args.weights not in ("float32", "as_file"):
        print(f"lamina generate: --weights {args.weights} is packed for the CPU in float32; on {device} in "
              f"{dtype} the weights are float32 (torch's linears)", file=sys.stderr)
        return 2
    what = pending_write(args.model)
    if what is not None:
        print(f"lamina generate: {what}; a minute or more", file=sys.stderr, flush=True)
    try:
        # Off the CPU's kernels, loaded in the dtype at once: the engine then only moves it.
        loaded = load_model(args.model, dtype=compute_dtype(dtype), weights=args.weights if native else "float32",
                            packed=native)
    except CheckpointError as exc:
        print(f"lamina generate: cannot load model: {exc}", file=sys.stderr)
        return 1
    print(f"loaded {loaded.source.name} in {loaded.load_seconds:.1f} s"
          f" ({'cached' if loaded.was_cached else 'converted once'}; weights {loaded.weights}:"
          f" {loaded.weight_formats})", file=sys.stderr)
    tok = loaded.tokenizer
    prompt_ids = tok.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else tok.encode(args.prompt)
    engine = Engine(loaded, EngineConfig(device=str(device), dtype=dtype, cuda_graphs=args.cuda_graphs))
    start = time.perf_counter()
    try:
        (out,) = engine.generate([prompt_ids], params)
    except ValueError as exc:
        print(f"lamina generate: {exc}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    print(out.text)
    print(f"{len(out.output_token_ids)} tokens in {elapsed:.2f} s, finish: {out.finish_reason}", file=sys.stderr)
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.output_token_ids}))
    return 0
