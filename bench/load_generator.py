"""A community load generator (guidellm) against `lamina up`, beside bench/serving.py's client.

One run starts `lamina up` (its defaults, on a free port), sends one untimed warm-up
request, then drives the same stack with two clients in turn, on the same workload:
N completions (`/v1/completions`, streamed, greedy) of P prompt tokens and exactly T
output tokens each (`ignore_eos`, as both tools send it), at most C at once (each
client keeps C requests in flight, sending the next when one ends):

- bench/serving.py's client (`replay`: the `openai` AsyncOpenAI client in this process,
  prompts as token ids, distinct from their first token);
- guidellm (`guidellm run`, profile `concurrent` with C streams, `synthetic_text` data
  of P prompt and T output tokens counted with the served checkpoint's own tokenizer,
  stopping after N requests), in its own process with its JSON report parsed here.

Prints the machine, the load average before each client, the workload, and per client
the output tokens/s, requests/s, time to first token p50/p99, inter-token latency
p50/p99/mean and the CPU time the client itself used, side by side with their ratio
(guidellm / serving.py); the last line is one JSON object. --guidellm-first swaps the
order. The two tools measure differently (docs/services.md, Benchmark: guidellm); the
table says what each number is.

guidellm is looked for at --guidellm, then $GUIDELLM, then on PATH; it is not one of
Lamina's dependencies (it pulls torch, datasets and dozens more, with pins of its own):
install it in a virtualenv of its own, torch pinned as the Makefile pins it, e.g.

    python -m venv /tmp/lg-venv && /tmp/lg-venv/bin/pip install torch==2.13.0 guidellm==0.8.1
    python bench/load_generator.py --guidellm /tmp/lg-venv/bin/guidellm

Without it the run is skipped with a message saying so (exit status 0, a JSON line with
"skipped"). No model hub is needed: guidellm's tokenizer is the Hugging Face directory
Lamina converted the GGUF checkpoint into (lamina.model.loader.resolve_checkpoint), and it runs
with HF_HUB_OFFLINE=1. Every process started here (lamina up and its services, guidellm
and its workers) is stopped on the way out, also on Ctrl-C, SIGTERM or an error.

    python bench/load_generator.py [--prompt-tokens 128 --output-tokens 32 --concurrency 8
                                    --requests 32 --guidellm-workers 1]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# bench/'s own modules import by name (a script's folder is on its path); lamina is the
# installed project's.
from cpu_anchor import lamina_up, raise_on_sigterm, signals_held
from engine_throughput import cpu_model
from serving import make_prompt_ids, replay

from lamina.lifetime import child_argv

ROOT = Path(__file__).resolve().parent.parent

TESTED_GUIDELLM = "0.8.1"  # the version whose command line and report format this script reads
GUIDELLM_TIMEOUT_S = 3600.0


@dataclasses.dataclass(frozen=True)
class Workload:
    requests: int  # N
    prompt_tokens: int  # P
    output_tokens: int  # T, forced
    concurrency: int  # C


@dataclasses.dataclass(frozen=True)
class Figures:
    """One client's measurement of one run; latencies in seconds."""

    output_tok_s: float
    requests_s: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    itl_mean: float  # the same for both tools: all gaps after first tokens / their number
    requests: int  # completed
    output_tokens: int
    seconds: float  # the measured window
    errored: int = 0
    client_cpu_s: float = 0.0  # CPU time the client itself used (its processes), beside the stack's


# -- guidellm -----------------------------------------------------------------------------------
def find_guidellm(explicit: str | None) -> Path | None:
    """--guidellm, else $GUIDELLM, else `guidellm` on PATH; None when none is there."""
    for candidate in (explicit, os.environ.get("GUIDELLM")):
        if candidate:
            path = Path(candidate)
            return path if path.is_file() and os.access(path, os.X_OK) else None
    found = shutil.which("guidellm")
    return Path(found) if found else None


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


def _stop_group(proc: subprocess.Popen | None, timeout_s: float = 30.0) -> None:
    """Stop a process started in its own session, and every process of that group
    (guidellm's workers), by its id."""
    if proc is None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout_s)
            break
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def _children_cpu_s() -> float:
    """CPU seconds of this process's children that have ended and been waited for
    (guidellm, and its workers once guidellm has reaped them)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_guidellm(argv: list[str], env: dict[str, str], workdir: Path) -> float:
    """Run guidellm to its end; its CPU seconds, its workers' included."""
    log = workdir / "guidellm.log"
    cpu = _children_cpu_s()
    proc = None
    try:
        with open(log, "w") as out:
            proc = subprocess.Popen(child_argv(argv), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, cwd=workdir, start_new_session=True)
        try:
            code = proc.wait(GUIDELLM_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"guidellm still running after {GUIDELLM_TIMEOUT_S:.0f} s; log {log}") from None
        if code != 0:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"guidellm exited with {code}:\n{tail}")
        return _children_cpu_s() - cpu
    finally:
        with signals_held():
            _stop_group(proc)


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


def side_by_side(serving: Figures, guidellm: Figures) -> str:
    lines = [f"{'':22s} {'serving.py':>12s} {'guidellm':>12s} {'guidellm/serving':>17s}"]
    for label, key, scale, fmt in ROWS:
        a, b = getattr(serving, key), getattr(guidellm, key)
        ratio = f"{b / a:.2f}" if a else "-"
        lines.append(f"{label:22s} {a * scale:>12{fmt}} {b * scale:>12{fmt}} {ratio:>17s}")
    return "\n".join(lines)


def ratios(serving: Figures, guidellm: Figures) -> dict[str, float | None]:
    return {key: (getattr(guidellm, key) / getattr(serving, key) if getattr(serving, key) else None)
            for _, key, _, _ in ROWS}


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32, help="requests per client (N)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompt length in tokens (P)")
    ap.add_argument("--output-tokens", type=int, default=32, help="output tokens per request, forced (T)")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight (C)")
    ap.add_argument("--guidellm", default=None, help="the guidellm executable (default: $GUIDELLM, then PATH)")
    ap.add_argument("--guidellm-workers", type=int, default=1,
                    help="guidellm's worker processes (GUIDELLM__MAX_WORKER_PROCESSES)")
    ap.add_argument("--guidellm-first", action="store_true", help="run guidellm before serving.py's client")
    ap.add_argument("--save-report", type=Path, default=None, help="keep guidellm's JSON report at this path")
    args = ap.parse_args()
    w = Workload(args.requests, args.prompt_tokens, args.output_tokens, args.concurrency)

    binary = find_guidellm(args.guidellm)
    if binary is None:
        why = (f"guidellm is not installed (looked at --guidellm, $GUIDELLM and PATH); install it in its own "
               f"virtualenv (pip install torch==2.13.0 guidellm=={TESTED_GUIDELLM}) and pass --guidellm")
        print(f"skipped: {why}")
        print(json.dumps({"skipped": why}))
        return
    raise_on_sigterm()
    version = guidellm_version(binary)
    if version != TESTED_GUIDELLM:
        print(f"note: guidellm {version}; this script reads the command line and report of {TESTED_GUIDELLM}")

    from lamina.model.loader import load_tokenizer, resolve_checkpoint

    gguf, hf_dir, _ = resolve_checkpoint(None)
    tokenizer, _ = load_tokenizer(gguf)
    prompts = serving_prompts(tokenizer, w)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    machine = {"cpu": cpu_model(), "cores": os.cpu_count(), "load_start": _load()}
    print(f"machine: {machine['cpu']}, {machine['cores']} cores, load average "
          f"{' '.join(map(str, machine['load_start']))} (1/5/15 min); commit {commit}")
    print(f"model: {gguf} (tokenizer for guidellm: {hf_dir})")
    print(f"workload: {w.requests} completions per client over the OpenAI API (streamed, greedy), "
          f"{w.prompt_tokens}-token prompts, exactly {w.output_tokens} output tokens (ignore_eos), "
          f"{w.concurrency} in flight; guidellm {version} at {binary} with {args.guidellm_workers} worker process(es)",
          flush=True)

    figures: dict[str, Figures] = {}
    with tempfile.TemporaryDirectory(prefix="load-generator-") as tmp:
        workdir = Path(tmp)
        try:
            with lamina_up([], workdir / "lamina-up.log") as url:
                import openai

                model = openai.OpenAI(base_url=url + "/v1", api_key="unused").models.list().data[0].id
                warm_up(url, model, tokenizer)
                report = workdir / "guidellm.json"
                argv = guidellm_argv(binary, url, model, hf_dir, w, report)

                def run_serving() -> Figures:
                    return run_serving_client(url, model, prompts, w)

                def run_load_generator() -> Figures:
                    cpu = run_guidellm(argv, guidellm_env(args.guidellm_workers), workdir)
                    if args.save_report is not None:
                        shutil.copyfile(report, args.save_report)
                    return dataclasses.replace(parse_guidellm_report(json.loads(report.read_text())),
                                               client_cpu_s=cpu)

                runs = [("serving", "bench/serving.py's client", run_serving),
                        ("guidellm", "guidellm", run_load_generator)]
                for name, label, run in (runs[::-1] if args.guidellm_first else runs):
                    machine[f"load_{name}"] = _load()
                    print(f"  {label} (load average {machine[f'load_{name}'][0]})...", flush=True)
                    figures[name] = run()
                machine["load_end"] = _load()
        except KeyboardInterrupt:
            print("interrupted: every process started here was stopped", file=sys.stderr)
            raise SystemExit(130) from None
    serving, guidellm = figures["serving"], figures["guidellm"]
    if guidellm.errored or guidellm.requests != w.requests:
        print(f"warning: guidellm completed {guidellm.requests} of {w.requests} requests, {guidellm.errored} errored")
    print(f"\nload average before serving.py's client {machine['load_serving']}, before guidellm "
          f"{machine['load_guidellm']}, at the end {machine['load_end']}")
    print(side_by_side(serving, guidellm))
    print("serving.py: TTFT from just before the request is sent to its first chunk with text; inter-token "
          "percentiles of every gap between chunks. guidellm: TTFT from its request start to the first token; "
          "inter-token percentiles of per-request means (last - first token) / (tokens - 1). Inter-token mean: one "
          "definition for both. Throughput: output tokens (or requests) over the measured window. Client CPU: the "
          "client's own processes, on the cores the stack uses.")
    result = {"serving_py": dataclasses.asdict(serving), "guidellm": dataclasses.asdict(guidellm),
              "ratio_guidellm_over_serving": ratios(serving, guidellm), "workload": dataclasses.asdict(w),
              "guidellm_version": version, "guidellm_workers": args.guidellm_workers,
              "order": "guidellm first" if args.guidellm_first else "serving.py first",
              "guidellm_argv": [str(a) for a in argv[1:]], "machine": machine, "commit": commit}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
