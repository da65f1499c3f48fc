"""CPU anchor: Lamina against llama.cpp's `llama-server` on the same GGUF file and the same load.

Compared, in one run, alternating:
- llama.cpp's `llama-server` on the model's GGUF file with `--threads` threads (2) and one
  slot per request (`-np N`, `-c N x 128` so every slot holds prompt and output), over
  its OpenAI API; found or built by `bench/llama_cpp.py` (a build takes about 8 minutes on
  2 cores and is cached outside the checkout);
- `lamina up` with its defaults (its layout the one `--layout auto` chooses; each
  `--weights` choice in turn, and each `--up-model-threads` value: the model worker's
  threads), over the OpenAI API;
- Lamina's local engine in this process (`Engine` with its defaults) with 1 and 2 compute
  threads (the packed products' threads; torch's ops on one), for each `--weights` choice.

Workload: N concurrent completions (48), each a distinct prompt of P token ids (15) and
exactly T output tokens (96: `ignore_eos`, checked in every reply), greedy. The servers
get the same requests from the same client code (the `openai` AsyncOpenAI client,
`/v1/completions`, all requests at once after one warm-up request); tokens/s is the
output tokens of all requests over the wall time from the first request sent to the
last reply. The engine gets the same prompts at once (`Engine.generate`) after a
warm-up.

Every server is started first and stays up (idle between its passes); then `--rounds`
rounds (3) each run every system once, in an order rotated by one each round, with the
cores other processes took during each pass (planner/measure/host_load.py's ForeignCpu).
`lamina up` and the engine with 2 threads, the pair of the 0.9x target, run back to back
in every round, which of them first alternating (`target_units`).
A system's figure is its median over rounds, and a ratio is the median over rounds of the
two systems' figures in the same round: these cores are shared and their speed drifts
over minutes, so figures taken far apart do not compare. Prints the machine (CPU, cores,
load average before and after), the workload, each pass, a table with every round's
figure, the ratios to llama.cpp and the targets (`lamina up` at least 1.15x
llama-server and 0.9x the engine with 2 threads); the last line is one JSON object.

Every process started here (llama-server, `lamina up` and its services) is stopped on
the way out, also on Ctrl-C, SIGTERM or an error, and ends with this process if it is
killed outright (`lamina.lifetime`).

    python bench/cpu_anchor.py [--requests 48 --prompt-tokens 15 --output-tokens 96
                                --llama-threads 2 --weights as_file,float32 --up-model-threads default,2
                                --rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

# bench/'s own modules import by name (a script's folder is on its path); lamina is the
# installed project's.
from engine_throughput import cpu_model
from llama_cpp import LlamaServerUnavailable, ensure_llama_server, server_version

from lamina.lifetime import child_argv, child_env
from lamina.planner.measure.host_load import ForeignCpu
from lamina.ports import free_port
from lamina.services.launch.launcher import health_ok

ROOT = Path(__file__).resolve().parent.parent

SLOT_MARGIN = 17  # tokens per llama-server slot beyond prompt and output (15 + 96 + 17 = 128)
START_TIMEOUT_S = 600.0


def make_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """n distinct prompts of exactly `length` token ids (text tokenized, cut or extended)."""
    topics = ["rivers", "mountains", "bread", "trains", "bees", "clocks", "glass", "storms", "maps", "salt", "owls",
              "bridges"]
    prompts = []
    for i in range(n):
        text = f"Request {i}: write a long story about {topics[i % len(topics)]} and what they teach us"
        ids = tokenizer.encode(text)
        while len(ids) < length:
            ids = ids + tokenizer.encode(" again")
        prompts.append(ids[:length])
    return prompts


# -- the client: the same for every server -----------------------------------------------------
async def _drive(base_url: str, prompts: list[list[int]], output_tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    try:
        model = (await client.models.list()).data[0].id

        async def one(prompt: list[int], max_tokens: int):
            reply = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                    temperature=0, extra_body={"ignore_eos": True})
            return reply.usage

        await one(prompts[0], 4)  # warm-up: first-request costs are not timed
        start = time.perf_counter()
        usages = await asyncio.gather(*(one(p, output_tokens) for p in prompts))
        seconds = time.perf_counter() - start
    finally:
        await client.close()
    out = [u.completion_tokens for u in usages]
    if any(n != output_tokens for n in out):
        raise RuntimeError(f"{base_url}: output tokens per request {sorted(set(out))}, not {output_tokens}")
    tokens = sum(out)
    return {"tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds,
            "prompt_tokens": sorted({u.prompt_tokens for u in usages})}


# -- processes -----------------------------------------------------------------------------------
def stop_process(proc: subprocess.Popen | None, timeout_s: float = 30.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_healthy(proc: subprocess.Popen, url: str, log: Path) -> None:
    """Poll llama-server's /health (503 while it loads the model) until 200."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited ({proc.returncode}); log {log}:\n{_tail(log)}")
        if health_ok(url):
            return
        time.sleep(0.2)  # no readiness event to wait on from outside the process
    raise TimeoutError(f"llama-server not healthy after {START_TIMEOUT_S:.0f} s; log {log}")


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@contextlib.contextmanager
def llama_server(binary: Path, gguf: Path, prompts, output_tokens: int, threads: int, log_dir: Path
                 ) -> Iterator[tuple[str, list[str]]]:
    """llama-server on a free port with one slot per request: yields (its base URL, its
    arguments) once healthy, and stops it on the way out."""
    n = len(prompts)
    ctx = n * (len(prompts[0]) + output_tokens + SLOT_MARGIN)
    port = free_port()
    argv = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(threads), "--threads-batch", str(threads), "-np", str(n), "-c", str(ctx)]
    log = log_dir / "llama-server.log"
    print(f"  llama-server: {' '.join(argv[1:])}", flush=True)
    proc = None
    try:
        with open(log, "w") as f:
            proc = subprocess.Popen(child_argv(argv), stdout=f, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        wait_healthy(proc, f"http://127.0.0.1:{port}", log)
        yield f"http://127.0.0.1:{port}", argv[1:]
    finally:
        with signals_held():
            stop_process(proc)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM ignored while a stop runs (main thread only), so that a second
    one cannot cut the stop short and leave a process running."""
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def lamina_up(options: list[str], log: Path, env: Mapping[str, str] | None = None) -> Iterator[str]:
    """`lamina up OPTIONS` on a free port, in this process's environment updated by `env`,
    its output in `log` and its services' logs in the directory beside it named after it
    (`--log-dir`): yields its base URL once it serves, and stops it (and with it every
    service it started) on the way out."""
    port = free_port()
    argv = [sys.executable, "-m", "lamina.cli", "up", "--port", str(port),
            "--log-dir", str(log.with_suffix(".services")), *options]
    print(f"  lamina {' '.join(argv[3:])}", flush=True)
    proc = None
    try:
        with open(log, "w") as err:
            # child_env: lamina up ends with this process even if it is killed outright,
            # and its services end with lamina up.
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                                    env=child_env({**os.environ, **(env or {})}), cwd=ROOT, text=True)
        lines: queue.Queue[str | None] = queue.Queue()

        def read() -> None:
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:  # lamina up prints this line once the stack is healthy
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"lamina up not serving after {START_TIMEOUT_S:.0f} s; log {log}") from None
            if line is None:
                raise RuntimeError(f"lamina up exited ({proc.wait()}); log {log}:\n{_tail(log)}")
            if "is serving the OpenAI API" in line:
                break
        yield f"http://127.0.0.1:{port}"
    finally:
        with signals_held():
            stop_process(proc, timeout_s=60.0)


class LocalEngine:
    """Lamina's engine in this process on one weights choice, loaded once; `run(threads)`
    is one timed pass of the workload on that many compute threads."""

    def __init__(self, weights: str, prompts, output_tokens: int) -> None:
        from lamina.engine import Engine, SamplingParams
        from lamina.model.loader import load_model

        self.engine = Engine(load_model(weights=weights))
        self.prompts = prompts
        self.output_tokens = output_tokens
        self.params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
        self.warm_up = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def run(self, threads: int) -> dict:
        from lamina.model.threads import set_compute_threads

        set_compute_threads(threads)  # the products on `threads` threads, torch's ops on one
        try:
            self.engine.generate(self.prompts[:1], self.warm_up)
            start = time.perf_counter()
            outs = self.engine.generate(self.prompts, self.params)
            seconds = time.perf_counter() - start
        finally:
            set_compute_threads(1)
        out = [len(o.output_token_ids) for o in outs]
        if any(n != self.output_tokens for n in out):
            raise RuntimeError(f"local engine: output tokens per request {sorted(set(out))}")
        return {"tok_s": sum(out) / seconds, "tokens": sum(out), "seconds": seconds,
                "prompt_tokens": sorted({o.prompt_tokens for o in outs})}


@dataclass
class Contender:
    """One system of the comparison: `run()` is one timed pass of the workload on it."""

    name: str
    system: str  # llama_cpp, lamina_up or local_engine
    run: Callable[[], dict]
    labels: dict = field(default_factory=dict)  # weights, threads, model_threads, argv
    passes: list[dict] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return statistics.median(p["tok_s"] for p in self.passes)


def timed_pass(contender: Contender) -> dict:
    """One pass, with the cores other processes took meanwhile."""
    others = ForeignCpu()
    result = contender.run()
    return {**result, "foreign_cores": others.cores()}


def round_order(n: int, round_index: int) -> list[int]:
    """The contenders' order in round `round_index`: rotated by one each round, so that no
    system always runs first (on a fresh page cache) or right after the same neighbour."""
    return [(i + round_index) % n for i in range(n)]


def unit_order(units: list[tuple[int, ...]], round_index: int) -> list[int]:
    """The contenders' order in round `round_index` when some run back to back: `units`
    (each a tuple of contender indices) rotated by one each round, as `round_order`
    rotates single contenders, and each unit's members in reverse order every other round,
    so that neither member of a pair always runs first."""
    rotated = [units[j] for j in round_order(len(units), round_index)]
    return [i for unit in rotated for i in (unit if round_index % 2 == 0 else unit[::-1])]


def target_pair(contenders: list[Contender], weights: str | None) -> tuple[int | None, int | None]:
    """The indices of the 0.9x target's pair: `lamina up` as a user starts it (its defaults,
    or the first --up-model-threads) on `weights`, and the local engine on 2 threads on the
    same weights; None for one that does not run."""
    up = next((i for i, c in enumerate(contenders) if c.system == "lamina_up" and c.labels["weights"] == weights),
              None)
    engine = next((i for i, c in enumerate(contenders) if c.system == "local_engine"
                   and c.labels["weights"] == weights and c.labels["threads"] == 2), None)
    return up, engine


def target_units(contenders: list[Contender], weights: str | None) -> list[tuple[int, ...]]:
    """The units a round rotates: the 0.9x target's pair (`target_pair`) as one unit that
    runs back to back; every other contender a unit of its own. Passes minutes apart on
    these shared cores compare less well than neighbours: the machine's speed drifts
    within minutes."""
    up, engine = target_pair(contenders, weights)
    pair = (up, engine) if up is not None and engine is not None else None
    units: list[tuple[int, ...]] = []
    for i in range(len(contenders)):
        if pair is None or i not in pair:
            units.append((i,))
        elif i == min(pair):
            units.append(pair)
    return units


def paired_ratio(a: Contender, b: Contender) -> float:
    """The median over rounds of a's tokens/s over b's in the same round."""
    return statistics.median(x["tok_s"] / y["tok_s"] for x, y in zip(a.passes, b.passes, strict=True))


def raise_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so every `finally` stops what it started."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def find_llama_server(skip: bool, what: str) -> tuple[Path | None, str | None, str | None]:
    """(llama-server's path, its version, why it is missing): found or built unless `skip`;
    says which and, when it is missing, that `what` is skipped."""
    if skip:
        return None, None, None
    try:
        binary = ensure_llama_server()
        version = server_version(binary)
    except LlamaServerUnavailable as exc:
        print(f"llama-server unavailable, {what} skipped: {exc}", flush=True)
        return None, None, str(exc)
    print(f"llama-server: {binary} ({version})", flush=True)
    return binary, version, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=48, help="concurrent completions (N)")
    ap.add_argument("--prompt-tokens", type=int, default=15, help="prompt length in tokens (P)")
    ap.add_argument("--output-tokens", type=int, default=96, help="output tokens per request, forced (T)")
    ap.add_argument("--llama-threads", type=int, default=2, help="llama-server --threads")
    ap.add_argument("--weights", default="as_file",
                    help="Lamina weights to run, comma-separated, side by side (as_file,float32,q8_0,q4)")
    ap.add_argument("--engine-threads", default="1,2",
                    help="compute threads of the local engine (lamina.model.threads.set_compute_threads), "
                         "comma-separated")
    ap.add_argument("--up-model-threads", default="default",
                    help="lamina up --model-threads values to run, comma-separated ('default': none given)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="passes of every system, alternating (each round runs each once); medians reported")
    ap.add_argument("--skip-llama", action="store_true", help="run only the Lamina rows")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    weights_list = [w.strip() for w in args.weights.split(",") if w.strip()]
    engine_threads = [int(t) for t in args.engine_threads.split(",")]
    up_threads = [None if t.strip() == "default" else int(t) for t in args.up_model_threads.split(",")]
    raise_on_sigterm()

    from lamina.model.checkpoints import load_tokenizer, resolve_checkpoint

    gguf = resolve_checkpoint(None)[0]
    tokenizer, _ = load_tokenizer(gguf)
    prompts = make_prompts(tokenizer, args.requests, args.prompt_tokens)
    load_before = os.getloadavg()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, load average "
          f"{' '.join(f'{x:.2f}' for x in load_before)} (1/5/15 min); commit {commit}")
    print(f"model: {gguf}")
    print(f"workload: {args.requests} concurrent completions over the OpenAI API, {args.prompt_tokens}-token "
          f"prompts (token ids), exactly {args.output_tokens} output tokens each (ignore_eos), greedy; "
          f"{args.rounds} round(s), every system once a round, in an order rotated each round", flush=True)

    binary, llama_version, llama_why = find_llama_server(args.skip_llama, "llama.cpp row")

    contenders: list[Contender] = []
    with tempfile.TemporaryDirectory(prefix="cpu-anchor-") as tmp, contextlib.ExitStack() as running:
        log_dir = Path(tmp)
        try:
            # Every server is started first and stays up, idle between its passes, so the
            # rounds can alternate the systems without a start between passes.
            if binary is not None:
                url, argv = running.enter_context(
                    llama_server(binary, gguf, prompts, args.output_tokens, args.llama_threads, log_dir))
                contenders.append(Contender(
                    f"llama-server, {args.llama_threads} threads, {args.requests} slots", "llama_cpp",
                    lambda url=url: asyncio.run(_drive(url, prompts, args.output_tokens)), {"argv": argv}))
            for w in weights_list:
                for t in up_threads:
                    options = ["--weights", w] + (["--model-threads", str(t)] if t is not None else [])
                    url = running.enter_context(lamina_up(options, log_dir / f"lamina-up-{w}-{t}.log"))
                    contenders.append(Contender(
                        f"lamina up, weights {w}" + (f", --model-threads {t}" if t is not None else ""),
                        "lamina_up", lambda url=url: asyncio.run(_drive(url, prompts, args.output_tokens)),
                        {"weights": w, "model_threads": t}))
            for w in weights_list:
                engine = LocalEngine(w, prompts, args.output_tokens)
                for threads in engine_threads:
                    contenders.append(Contender(
                        f"local engine, weights {w}, {threads} thread(s)", "local_engine",
                        lambda engine=engine, threads=threads: engine.run(threads), {"weights": w, "threads": threads}))
            units = target_units(contenders, weights_list[0] if weights_list else None)
            if any(len(u) == 2 for u in units):
                print("  lamina up and the local engine on 2 threads run back to back, which first alternating",
                      flush=True)
            for r in range(args.rounds):
                for i in unit_order(units, r):
                    c = contenders[i]
                    result = timed_pass(c)
                    c.passes.append(result)
                    print(f"  round {r + 1}/{args.rounds}: {c.name}: {result['tok_s']:.1f} tok/s "
                          f"(other processes {result['foreign_cores']:.2f} cores)", flush=True)
        except KeyboardInterrupt:
            print("interrupted: every process started here is being stopped", file=sys.stderr)
            raise SystemExit(130) from None

    load_after = os.getloadavg()
    print_report(args, contenders, load_before, load_after, commit, llama_version, llama_why, weights_list)


def print_report(args, contenders: list[Contender], load_before, load_after, commit: str,
                 llama_version: str | None, llama_why: str | None, weights_list: list[str]) -> None:
    """The table (medians over rounds, each round's figure beside), the paired ratios, the
    targets, and the last line's JSON."""
    llama = next((c for c in contenders if c.system == "llama_cpp"), None)
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in load_after)}")
    print(f"{'system':44s} {'tok/s':>8s}  {'each round':24s} {'vs llama.cpp':>12s}  prompt tokens")
    for c in contenders:
        ratio = f"{paired_ratio(c, llama):11.2f}x" if llama else f"{'-':>12s}"
        rounds = " ".join(f"{p['tok_s']:.1f}" for p in c.passes)
        print(f"{c.name:44s} {c.tok_s:8.1f}  {rounds:24s} {ratio}  {c.passes[0]['prompt_tokens']}")
    print("(tok/s: the median over rounds; ratios: the median over rounds of the two systems' figures in the "
          "same round)")

    first = weights_list[0] if weights_list else None
    up_index, two_index = target_pair(contenders, first)
    up = contenders[up_index] if up_index is not None else None
    two_threads = contenders[two_index] if two_index is not None else None
    local = {c.labels["threads"]: c for c in contenders
             if c.system == "local_engine" and c.labels["weights"] == first}
    best_local = max(local.values(), key=lambda c: c.tok_s) if local else None
    targets = {}
    if llama and best_local is not None:
        targets["local engine >= 1.0x llama.cpp"] = paired_ratio(best_local, llama) >= 1.0
    if llama and up is not None:
        targets["lamina up >= 1.15x llama.cpp"] = paired_ratio(up, llama) >= 1.15
    if up is not None and two_threads is not None:
        targets["lamina up >= 0.9x local engine, 2 threads"] = paired_ratio(up, two_threads) >= 0.9
        print(f"lamina up vs local engine, 2 threads: {paired_ratio(up, two_threads):.2f}x")
    for name, ok in targets.items():
        print(f"target {name} ({first}): {'met' if ok else 'MISSED'}")
    print(json.dumps({
        "llama_cpp_tok_s": llama.tok_s if llama else None, "lamina_up_tok_s": up.tok_s if up else None,
        "local_engine_tok_s": best_local.tok_s if best_local else None,
        "local_engine_tok_s_by_threads": {t: c.tok_s for t, c in local.items()},
        "lamina_up_tok_s_by_model_threads": {str(c.labels["model_threads"] or "default"): c.tok_s
                                             for c in contenders if c.system == "lamina_up"
                                             and c.labels["weights"] == first},
        "weights": first,
        "lamina_up_vs_llama_cpp": paired_ratio(up, llama) if llama and up else None,
        "local_engine_vs_llama_cpp": paired_ratio(best_local, llama) if llama and best_local else None,
        "lamina_up_vs_local_engine_2_threads": paired_ratio(up, two_threads) if up and two_threads else None,
        "targets": targets, "llama_cpp_unavailable": llama_why, "llama_server_version": llama_version,
        "workload": {"requests": args.requests, "prompt_tokens": args.prompt_tokens,
                     "output_tokens": args.output_tokens, "llama_threads": args.llama_threads,
                     "rounds": args.rounds},
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "load_before": load_before,
                    "load_after": load_after},
        "commit": commit,
        "rows": [{"name": c.name, "system": c.system, "tok_s": c.tok_s,
                  **{k: v for k, v in c.labels.items() if k != "argv"},
                  "passes": [{k: v for k, v in p.items() if k != "prompt_tokens"} for p in c.passes]}
                 for c in contenders],
    }))


if __name__ == "__main__":
    main()
