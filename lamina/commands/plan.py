"""`lamina plan`: which deployment, quantization and thread counts serve a workload fastest
and cheapest, predicted by the planner's performance models (docs/planner.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_PROFILE = Path.home() / ".cache" / "lamina" / "profile.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="what lamina up --model takes: a built-in name (e.g. llama-3-70b), random:SHAPE "
                        "(e.g. random:llama-3.1-8b), a config.json, a checkpoint dir or a .gguf file")
    p.add_argument("--hardware", default=None,
                   help="catalogue kinds the planner may combine, optionally with counts: H100:8,H20:16 or H100,H20 "
                        "(default: every catalogue kind, for a --budget)")
    p.add_argument("--trace", default=None, help="a trace file (../shared/traces formats: Azure CSV, Kimi JSONL)")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="with --output-tokens and --rate, instead of --trace")
    p.add_argument("--output-tokens", type=int, default=None)
    p.add_argument("--rate", type=float, default=None, help="requests per second (Poisson arrivals)")
    p.add_argument("--budget", type=float, default=None, help="USD per hour, all devices together")
    p.add_argument("--tbt-ms", type=float, default=None, help="time-between-tokens target")
    p.add_argument("--ttft-ms", type=float, default=None, help="time-to-first-token target")
    p.add_argument("--quantize", default="any", choices=("none", "weights", "kv", "any"),
                   help="which 4-bit quantization choices to consider (default: any)")
    p.add_argument("--colocated-only", action="store_true", help="do not consider disaggregated layouts")
    p.add_argument("--decode-only", action="store_true",
                   help="rank the decode phase alone (prefill served and paid for elsewhere)")
    p.add_argument("--top", type=int, default=10, help="configurations to show")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--simulate", action="store_true", help="check the top choices with the discrete-event simulator")
    p.add_argument("--simulate-top", type=int, default=3, help="how many top choices --simulate checks")
    p.add_argument("--simulate-requests", type=int, default=2000,
                   help="replay the first N requests of the workload (default 2000)")
    p.add_argument("--profile", type=Path, default=None,
                   help=f"a profile JSON for the `this-machine` entry (default: {DEFAULT_PROFILE} if it exists)")


def _workload(args: argparse.Namespace):
    from lamina.planner.workload import load_trace, synthetic

    if args.trace:
        return load_trace(args.trace)
    if None in (args.prompt_tokens, args.output_tokens, args.rate):
        raise ValueError("give --trace, or all of --prompt-tokens, --output-tokens and --rate")
    return synthetic(args.prompt_tokens, args.output_tokens, args.rate, max(args.simulate_requests, 1000))


def run(args: argparse.Namespace) -> int:
    from lamina.model.errors import CheckpointError
    from lamina.planner.estimate import Targets
    from lamina.planner.hardware import THIS_MACHINE, load_catalogue, parse_hardware
    from lamina.planner.plan import plan
    from lamina.planner.report import table, to_dict, verdict_lines, verdicts
    from lamina.planner.shapes import resolve_model

    profile = args.profile or (DEFAULT_PROFILE if DEFAULT_PROFILE.is_file() else None)
    try:
        catalogue = load_catalogue(profile)
        shape = resolve_model(args.model)
        offer = parse_hardware(args.hardware or ",".join(k for k in catalogue if k != THIS_MACHINE), catalogue)
        workload = _workload(args)
    except (OSError, ValueError, KeyError, CheckpointError) as exc:
        print(f"lamina plan: {exc}", file=sys.stderr)
        return 2
    stats = workload.stats()
    targets = Targets(tbt_s=None if args.tbt_ms is None else args.tbt_ms / 1e3,
                      ttft_s=None if args.ttft_ms is None else args.ttft_ms / 1e3,
                      budget_usd_h=args.budget)
    ranked = plan(shape, offer, catalogue, stats, targets, args.quantize, not args.colocated_only, args.decode_only)
    shown = ranked[: args.top]
    simulated: dict[int, dict] = {}
    if args.simulate:
        from lamina.planner.simulate import simulate, simulated_shortfalls

        sample = workload.head(min(args.simulate_requests, len(workload.requests)))
        for i, e in enumerate(shown[: args.simulate_top]):
            result = simulate(shape, e.layout, catalogue, sample, e.replicas, e.batch)
            simulated[i] = {**result.to_dict(),
                            "shortfalls_p90": list(simulated_shortfalls(result, targets.tbt_s, targets.ttft_s))}
    if args.json:
        print(json.dumps({
            "model": shape.name,
            "workload": {"name": workload.name, "requests": stats.requests, "rate_per_s": round(stats.rate, 3),
                         "mean_prompt": round(stats.mean_prompt, 1), "mean_output": round(stats.mean_output, 1),
                         "demand_tok_s": round(stats.output_tok_s, 1)},
            "considered": len(ranked),
            "configurations": [to_dict(e, simulated.get(i)) for i, e in enumerate(shown)],
            **({"this_machine_quantization": verdicts(catalogue[THIS_MACHINE])}
               if THIS_MACHINE in offer.limits else {}),
        }, indent=2))
        return 0 if ranked else 1
    print(f"model {shape.name} ({shape.num_params / 1e9:.2f}B parameters); workload {workload.name}: "
          f"{stats.requests} requests, {stats.rate:.2f}/s, mean prompt {stats.mean_prompt:.0f}, "
          f"mean output {stats.mean_output:.0f} -> {stats.output_tok_s:.0f} output tok/s")
    if not ranked:
        print("no configuration can run this model on this hardware")
        return 1
    print(f"{len(ranked)} configurations considered; tok/s is the capacity of all replicas, "
          f"TBT the step at that load, $/Mtok per output token at full load\n")
    print(table(shown))
    if THIS_MACHINE in offer.limits:
        print("\n" + verdict_lines(THIS_MACHINE, catalogue[THIS_MACHINE]))
    for i, sim in simulated.items():
        print(f"\nsimulated #{i + 1} ({sim['completed']} requests): {sim['throughput_tok_s']} tok/s, "
              f"TTFT ms {sim['ttft_ms']}, TBT ms {sim['tbt_ms']}, mean batch {sim['mean_batch']}, "
              f"preemptions {sim['preemptions']}"
              + (f"; misses at p90: {', '.join(sim['shortfalls_p90'])}" if sim["shortfalls_p90"] else ""))
    return 0
