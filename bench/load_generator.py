"""Community load generators (guidellm, aiperf) against `lamina up`, beside bench/serving.py's client.

One run starts `lamina up` (its defaults, on a free port), sends one untimed warm-up
request, then drives the same stack with each client in turn, on the same workload:
N completions (`/v1/completions`, streamed, greedy) of P prompt tokens and exactly T
output tokens each (`ignore_eos`, as every tool sends it), at most C at once (each
client keeps C requests in flight, sending the next when one ends):

- bench/serving.py's client (`replay`: the `openai` AsyncOpenAI client in this process,
  prompts as token ids, distinct from their first token);
- guidellm (`guidellm run`, profile `concurrent` with C streams, `synthetic_text` data
  of P prompt and T output tokens counted with the served checkpoint's own tokenizer,
  stopping after N requests), in its own process with its JSON report parsed here;
- aiperf (`aiperf profile`, endpoint type `completions`, concurrency C, N requests of
  synthetic prompts of P tokens by the same tokenizer and T output tokens, token counts
  from the server's usage: bench/aiperf_client.py), in its own processes with its JSON
  export parsed here.

Prints the machine, the load average before each client, the workload, and per client
the output tokens/s, requests/s, time to first token p50/p99, inter-token latency
p50/p99/mean and the CPU time the client itself used, side by side with each tool's
ratio to serving.py's; the last line is one JSON object. --tools picks the tools
(default guidellm,aiperf); --tools-first runs them before serving.py's client. The
tools measure differently (docs/services.md, Benchmark: guidellm); the table says what
each number is.

Each tool is looked for at its option (--guidellm, --aiperf), then its variable
($GUIDELLM, $AIPERF), then on PATH; neither is one of Lamina's dependencies (each pulls
torch and dozens more, with pins of their own): install each in a virtualenv of its own,
torch pinned as the Makefile pins it, e.g.

    python -m venv /tmp/lg-venv && /tmp/lg-venv/bin/pip install torch==2.13.0 guidellm==0.8.1
    python3.11 -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install torch==2.13.0 'aiperf==0.13.*'
    python bench/load_generator.py --guidellm /tmp/lg-venv/bin/guidellm --aiperf /tmp/aiperf-venv/bin/aiperf

A tool that is not found is skipped with a message naming it and where it was looked
for; with none found the run is skipped (exit status 0, a JSON line with "skipped"). No
model hub is needed: each tool's tokenizer is the Hugging Face directory Lamina
converted the GGUF checkpoint into (lamina.model.checkpoints.resolve_checkpoint); guidellm runs
with HF_HUB_OFFLINE=1, aiperf with the hub's address a closed local port (aiperf 0.13
cannot read a tokenizer directory with HF_HUB_OFFLINE set: bench/aiperf_client.py).
Every process started here (lamina up and its services, each tool
and its workers) is stopped on the way out, also on Ctrl-C, SIGTERM or an error.

    python bench/load_generator.py [--prompt-tokens 128 --output-tokens 32 --concurrency 8
                                    --requests 32 --guidellm-workers 1 --aiperf-workers 1]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# bench/'s own modules import by name (a script's folder is on its path); lamina is the
# installed project's.
from aiperf_client import (
    EXPORT_NAME,
    TESTED_AIPERF,
    aiperf_argv,
    aiperf_env,
    aiperf_version,
    find_aiperf,
    parse_aiperf_export,
)
from cpu_anchor import lamina_up, raise_on_sigterm
from engine_throughput import cpu_model
from load_clients import Figures, Workload, find_executable, run_client
from serving import make_prompt_ids, replay

ROOT = Path(__file__).resolve().parent.parent

TESTED_GUIDELLM = "0.8.1"  # the version whose command line and report format this script reads
TOOLS = ("guidellm", "aiperf")


# -- guidellm -----------------------------------------------------------------------------------
def find_guidellm(explicit: str | None) -> Path | None:
    """--guidellm, else $GUIDELLM, else `guidellm` on PATH; None when none is there."""
    return find_executable("guidellm", explicit, "GUIDELLM")


def guidellm_version(binary: Path) -> str:
    """The version `guidellm --version` prints ("guidellm version: 0.8.1")."""
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=120).stdout.split()
    return out[-1] if out else "unknown"


def guidellm_argv(binary: Path, url: str, model: str, tokenizer_dir: Path, w: Workload, report: Path) -> list[str]:
    """`guidellm run` on the workload: completions with text prompts of P tokens (by the
    served checkpoint's tokenizer) and T output tokens, which guidellm forces by sending
    `ignore_eos` and `stop: null` with max_tokens T; C concurrent streams; N requests."""
    return [str(binary), "run",
            "--backend", f"kind=openai_http,target={url},model={model},request_format=/v1/completions",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
            "--data", f"kind=synthetic_text,prompt_tokens={w.prompt_tokens},output_tokens={w.output_tokens}",
            "--profile", f"kind=concurrent,streams={w.concurrency}",
            "--constraint", f"kind=max_requests,count={w.requests}",
            "--output", f"kind=json,path={report}",
            "--disable-console-interactive"]


def guidellm_env(workers: int) -> dict[str, str]:
    """No model hub; `workers` worker processes (guidellm's default is up to 10, which on
    a 2-core host take the cores the stack needs)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "GUIDELLM__MAX_WORKER_PROCESSES": str(workers)}


def parse_guidellm_report(doc: dict) -> Figures:
    """guidellm's JSON report (format version 2, guidellm 0.8.x) -> Figures.

    Its rates are over the benchmark's measured window (first request started to last
    ended); `mean` of a rate distribution is that total rate. TTFT is per request, from
    the start of its HTTP request to the first streamed token; ITL is per request
    (last token - first token) / (output tokens - 1), weighted by output tokens - 1, so
    its percentiles are of per-request means, not of single gaps."""
    version = doc.get("metadata", {}).get("version")
    if version != 2:
        raise ValueError(f"guidellm report format version {version!r}, expected 2")
    benchmarks = doc.get("benchmarks") or []
    if len(benchmarks) != 1:
        raise ValueError(f"expected one benchmark in the guidellm report, found {len(benchmarks)}")
    bench = benchmarks[0]
    m = bench["metrics"]

    def ok(name: str) -> dict:
        return m[name]["successful"]

    def pct(name: str, q: str) -> float:
        return ok(name)["percentiles"][q] / 1000.0  # guidellm reports these in ms

    return Figures(
        output_tok_s=ok("output_tokens_per_second")["mean"],
        requests_s=ok("requests_per_second")["mean"],
        ttft_p50=pct("time_to_first_token_ms", "p50"), ttft_p99=pct("time_to_first_token_ms", "p99"),
        itl_p50=pct("inter_token_latency_ms", "p50"), itl_p99=pct("inter_token_latency_ms", "p99"),
        itl_mean=ok("inter_token_latency_ms")["mean"] / 1000.0,
        requests=m["request_totals"]["successful"], errored=m["request_totals"]["errored"],
        output_tokens=int(ok("output_token_count")["total_sum"]), seconds=bench["duration"])


# -- bench/serving.py's client -----------------------------------------------------------------
def serving_prompts(tokenizer, w: Workload) -> list[list[int]]:
    """N prompts of exactly P token ids, distinct from their first tokens (as guidellm's
    are), so no request finds another's prefix in the prefix cache."""
    prompts = []
    for i in range(w.requests):
        ids = tokenizer.encode(f"{i}.") + make_prompt_ids(tokenizer, w.prompt_tokens, i)
        prompts.append(ids[:w.prompt_tokens])
    return prompts


def run_serving_client(url: str, model: str, prompts: list[list[int]], w: Workload) -> Figures:
    workload = [(0.0, w.prompt_tokens, w.output_tokens)] * w.requests  # all arrive at once, C at a time
    cpu = time.process_time()
    r = asyncio.run(replay(url, model, workload, prompts, concurrency=w.concurrency))
    cpu = time.process_time() - cpu
    if r["tokens"] != w.requests * w.output_tokens:
        raise RuntimeError(f"serving.py's client got {r['tokens']} output tokens, not {w.requests * w.output_tokens}")
    return Figures(output_tok_s=r["tok_s"], requests_s=w.requests / r["seconds"],
                   ttft_p50=r["ttft_s"]["p50"], ttft_p99=r["ttft_s"]["p99"],
                   itl_p50=r["tbt_s"]["p50"], itl_p99=r["tbt_s"]["p99"], itl_mean=r["tbt_s"]["mean"], client_cpu_s=cpu,
                   requests=w.requests, output_tokens=r["tokens"], seconds=r["seconds"])


def warm_up(url: str, model: str, tokenizer) -> None:
    """One short request, untimed, so neither client pays the stack's first-request costs."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    client.completions.create(model=model, prompt=tokenizer.encode("warm up"), max_tokens=4, temperature=0)


# -- report ------------------------------------------------------------------------------------
ROWS = [("output tokens/s", "output_tok_s", 1.0, ".2f"), ("requests/s", "requests_s", 1.0, ".3f"),
        ("TTFT p50 (s)", "ttft_p50", 1.0, ".2f"), ("TTFT p99 (s)", "ttft_p99", 1.0, ".2f"),
        ("inter-token p50 (ms)", "itl_p50", 1000.0, ".0f"), ("inter-token p99 (ms)", "itl_p99", 1000.0, ".0f"),
        ("inter-token mean (ms)", "itl_mean", 1000.0, ".0f"), ("client CPU (s)", "client_cpu_s", 1.0, ".1f")]


def side_by_side(serving: Figures, tools: dict[str, Figures]) -> str:
    """The table: serving.py's figures, then each tool's and its ratio to serving.py's."""
    heads = "".join(f" {name:>12s} {name + '/serving':>17s}" for name in tools)
    lines = [f"{'':22s} {'serving.py':>12s}{heads}"]
    for label, key, scale, fmt in ROWS:
        a = getattr(serving, key)
        cells = ""
        for figures in tools.values():
            b = getattr(figures, key)
            ratio = f"{b / a:.2f}" if a else "-"
            cells += f" {b * scale:>12{fmt}} {ratio:>17s}"
        lines.append(f"{label:22s} {a * scale:>12{fmt}}{cells}")
    return "\n".join(lines)


def ratios(serving: Figures, tool: Figures) -> dict[str, float | None]:
    return {key: (getattr(tool, key) / getattr(serving, key) if getattr(serving, key) else None)
            for _, key, _, _ in ROWS}


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


@dataclasses.dataclass(frozen=True)
class LoadTool:
    """One external load generator, found, with how to run it and read its result."""

    name: str
    binary: Path
    version: str
    workers: int
    argv: Callable[[str, str, Path, Workload, Path], list[str]]  # (url, model, tokenizer dir, workload, workdir)
    env: dict[str, str]
    result: Callable[[Path], Path]  # workdir -> its JSON report
    parse: Callable[[dict], Figures]


def missing_tool(name: str) -> str:
    """Why `name` is skipped: where it was looked for, and how to install it."""
    pin = {"guidellm": f"guidellm=={TESTED_GUIDELLM}", "aiperf": f"'aiperf=={TESTED_AIPERF.rsplit('.', 1)[0]}.*'"}
    return (f"{name} is not installed (looked at --{name}, ${name.upper()} and PATH); install it in its own "
            f"virtualenv (pip install torch==2.13.0 {pin[name]}) and pass --{name}")


def find_tools(args: argparse.Namespace) -> tuple[list[LoadTool], dict[str, str]]:
    """The tools asked for (--tools) that are found, and why each of the others is skipped."""
    found, skipped = [], {}
    for name in args.tools.split(","):
        if name not in TOOLS:
            raise SystemExit(f"--tools: unknown tool {name!r} (known: {', '.join(TOOLS)})")
        binary = (find_guidellm if name == "guidellm" else find_aiperf)(getattr(args, name))
        if binary is None:
            skipped[name] = missing_tool(name)
        elif name == "guidellm":
            found.append(LoadTool(
                name, binary, guidellm_version(binary), args.guidellm_workers,
                lambda url, model, tok, w, d, b=binary: guidellm_argv(b, url, model, tok, w, d / "guidellm.json"),
                guidellm_env(args.guidellm_workers), lambda d: d / "guidellm.json", parse_guidellm_report))
        else:
            found.append(LoadTool(
                name, binary, aiperf_version(binary), args.aiperf_workers,
                lambda url, model, tok, w, d, b=binary: aiperf_argv(b, url, model, tok, w, d / "aiperf",
                                                                    args.aiperf_workers),
                aiperf_env(), lambda d: d / "aiperf" / EXPORT_NAME, parse_aiperf_export))
    return found, skipped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32, help="requests per client (N)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompt length in tokens (P)")
    ap.add_argument("--output-tokens", type=int, default=32, help="output tokens per request, forced (T)")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight (C)")
    ap.add_argument("--tools", default=",".join(TOOLS),
                    help="the load generators to run, in this order (default: %(default)s)")
    ap.add_argument("--guidellm", default=None, help="the guidellm executable (default: $GUIDELLM, then PATH)")
    ap.add_argument("--guidellm-workers", type=int, default=1,
                    help="guidellm's worker processes (GUIDELLM__MAX_WORKER_PROCESSES)")
    ap.add_argument("--aiperf", default=None, help="the aiperf executable (default: $AIPERF, then PATH)")
    ap.add_argument("--aiperf-workers", type=int, default=1, help="aiperf's worker processes (--workers-max)")
    ap.add_argument("--tools-first", "--guidellm-first", dest="tools_first", action="store_true",
                    help="run the load generators before serving.py's client")
    ap.add_argument("--save-report", type=Path, default=None,
                    help="keep each tool's JSON report in this folder (NAME.json)")
    args = ap.parse_args()
    w = Workload(args.requests, args.prompt_tokens, args.output_tokens, args.concurrency)

    tools, skipped = find_tools(args)
    if not tools:
        why = "; ".join(skipped.values())
        print(f"skipped: {why}")
        print(json.dumps({"skipped": why}))
        return
    for why in skipped.values():
        print(f"note: skipped: {why}")
    raise_on_sigterm()
    tested = {"guidellm": TESTED_GUIDELLM, "aiperf": TESTED_AIPERF}
    for t in tools:
        if t.version != tested[t.name]:
            print(f"note: {t.name} {t.version}; this script reads the command line and report of {tested[t.name]}")

    from lamina.model.checkpoints import load_tokenizer, resolve_checkpoint

    gguf, hf_dir, _ = resolve_checkpoint(None)
    tokenizer, _ = load_tokenizer(gguf)
    prompts = serving_prompts(tokenizer, w)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    machine = {"cpu": cpu_model(), "cores": os.cpu_count(), "load_start": _load()}
    print(f"machine: {machine['cpu']}, {machine['cores']} cores, load average "
          f"{' '.join(map(str, machine['load_start']))} (1/5/15 min); commit {commit}")
    print(f"model: {gguf} (tokenizer for the tools: {hf_dir})")
    print(f"workload: {w.requests} completions per client over the OpenAI API (streamed, greedy), "
          f"{w.prompt_tokens}-token prompts, exactly {w.output_tokens} output tokens (ignore_eos), "
          f"{w.concurrency} in flight; " + ", ".join(f"{t.name} {t.version} at {t.binary} with {t.workers} worker "
                                                    f"process(es)" for t in tools), flush=True)

    figures: dict[str, Figures] = {}
    argvs: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="load-generator-") as tmp:
        workdir = Path(tmp)
        try:
            with lamina_up([], workdir / "lamina-up.log") as url:
                import openai

                model = openai.OpenAI(base_url=url + "/v1", api_key="unused").models.list().data[0].id
                warm_up(url, model, tokenizer)

                def run_serving() -> Figures:
                    return run_serving_client(url, model, prompts, w)

                def run_tool(t: LoadTool) -> Callable[[], Figures]:
                    def run() -> Figures:
                        argvs[t.name] = t.argv(url, model, hf_dir, w, workdir)
                        cpu = run_client(t.name, argvs[t.name], t.env, workdir)
                        report = t.result(workdir)
                        if args.save_report is not None:
                            args.save_report.mkdir(parents=True, exist_ok=True)
                            shutil.copyfile(report, args.save_report / f"{t.name}.json")
                        return dataclasses.replace(t.parse(json.loads(report.read_text())), client_cpu_s=cpu)
                    return run

                runs = [(t.name, t.name, run_tool(t)) for t in tools]
                serving_run = ("serving", "bench/serving.py's client", run_serving)
                for name, label, run in ([*runs, serving_run] if args.tools_first else [serving_run, *runs]):
                    machine[f"load_{name}"] = _load()
                    print(f"  {label} (load average {machine[f'load_{name}'][0]})...", flush=True)
                    figures[name] = run()
                machine["load_end"] = _load()
        except KeyboardInterrupt:
            print("interrupted: every process started here was stopped", file=sys.stderr)
            raise SystemExit(130) from None
    serving = figures.pop("serving")
    for name, f in figures.items():
        if f.errored or f.requests != w.requests:
            print(f"warning: {name} completed {f.requests} of {w.requests} requests, {f.errored} errored")
        if f.output_tokens != w.requests * w.output_tokens:
            print(f"warning: {name} counted {f.output_tokens} output tokens, not {w.requests * w.output_tokens}")
    print("\nload average before " + ", before ".join(
        f"{'serving.py' if name == 'serving' else name} {machine[f'load_{name}']}"
        for name in ["serving", *figures]) + f", at the end {machine['load_end']}")
    print(side_by_side(serving, figures))
    print("serving.py: TTFT from just before the request is sent to its first chunk with text; inter-token "
          "percentiles of every gap between chunks. guidellm and aiperf: TTFT from the request's start to its first "
          "token; inter-token percentiles of per-request means (last - first token) / (tokens - 1). Inter-token "
          "mean: one definition for all. Throughput: output tokens (or requests) over the measured window. Client "
          "CPU: the client's own processes, on the cores the stack uses.")
    result: dict = {"serving_py": dataclasses.asdict(serving), "workload": dataclasses.asdict(w),
                    "order": "tools first" if args.tools_first else "serving.py first"}
    for t in tools:
        result |= {t.name: dataclasses.asdict(figures[t.name]),
                   f"ratio_{t.name}_over_serving": ratios(serving, figures[t.name]),
                   f"{t.name}_version": t.version, f"{t.name}_workers": t.workers,
                   f"{t.name}_argv": [str(a) for a in argvs[t.name][1:]]}
    result |= {"skipped": skipped, "machine": machine, "commit": commit}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
