"""CPU anchor: Lamina against llama.cpp's `llama-server` on the same GGUF file and the same load.

Compared, in one run, each in turn:
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
warm-up. Prints the machine (CPU, cores, load average before and after), the workload, a
table and the ratios to llama.cpp; the last line is one JSON object.

Every process started here (llama-server, `lamina up` and its services) is stopped on
the way out, also on Ctrl-C, SIGTERM or an error, and ends with this process if it is
killed outright (`lamina.lifetime`).

    python bench/cpu_anchor.py [--requests 48 --prompt-tokens 15 --output-tokens 96
                                --llama-threads 2 --weights as_file,float32 --up-model-threads default,2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

# bench/'s own modules import by name (a script's folder is on its path); lamina is the
# installed project's.
from engine_throughput import cpu_model
from llama_cpp import LlamaServerUnavailable, ensure_llama_server, server_version

from lamina.lifetime import child_argv, child_env
from lamina.services.launch.launcher import health_ok

ROOT = Path(__file__).resolve().parent.parent

SLOT_MARGIN = 17  # tokens per llama-server slot beyond prompt and output (15 + 96 + 17 = 128)
START_TIMEOUT_S = 600.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def run_llama_server(binary: Path, gguf: Path, prompts, output_tokens: int, threads: int, log_dir: Path) -> dict:
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
        return {**asyncio.run(_drive(f"http://127.0.0.1:{port}", prompts, output_tokens)), "argv": argv[1:]}
    finally:
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
def lamina_up(options: list[str], log: Path) -> Iterator[str]:
    """`lamina up OPTIONS` on a free port: yields its base URL once it serves, and stops it
    (and with it every service it started) on the way out."""
    port = free_port()
    argv = [sys.executable, "-m", "lamina.cli", "up", "--port", str(port), *options]
    print(f"  lamina {' '.join(argv[3:])}", flush=True)
    proc = None
    try:
        with open(log, "w") as err:
            # child_env: lamina up ends with this process even if it is killed outright,
            # and its services end with lamina up.
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                                    env=child_env(), cwd=ROOT, text=True)
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


def run_lamina_up(weights: str, prompts, output_tokens: int, log_dir: Path, model_threads: int | None = None) -> dict:
    options = ["--weights", weights]
    if model_threads is not None:
        options += ["--model-threads", str(model_threads)]
    with lamina_up(options, log_dir / f"lamina-up-{weights}-{model_threads}.log") as url:
        return asyncio.run(_drive(url, prompts, output_tokens))


def run_engine(weights: str, prompts, output_tokens: int, threads_list: list[int]) -> dict[int, dict]:
    from lamina.engine import Engine, SamplingParams
    from lamina.model.loader import load_model
    from lamina.model.threads import set_compute_threads

    loaded = load_model(weights=weights)
    engine = Engine(loaded)
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    results = {}
    try:
        for threads in threads_list:
            set_compute_threads(threads)  # the products on `threads` threads, torch's ops on one
            engine.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            start = time.perf_counter()
            outs = engine.generate(prompts, params)
            seconds = time.perf_counter() - start
            out = [len(o.output_token_ids) for o in outs]
            if any(n != output_tokens for n in out):
                raise RuntimeError(f"local engine: output tokens per request {sorted(set(out))}")
            results[threads] = {"tok_s": sum(out) / seconds, "tokens": sum(out), "seconds": seconds,
                                "prompt_tokens": sorted({o.prompt_tokens for o in outs})}
            print(f"  local engine, {weights}, {threads} thread(s): {results[threads]['tok_s']:.1f} tok/s",
                  flush=True)
    finally:
        set_compute_threads(1)
    return results


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
    ap.add_argument("--skip-llama", action="store_true", help="run only the Lamina rows")
    args = ap.parse_args()
    weights_list = [w.strip() for w in args.weights.split(",") if w.strip()]
    engine_threads = [int(t) for t in args.engine_threads.split(",")]
    up_threads = [None if t.strip() == "default" else int(t) for t in args.up_model_threads.split(",")]
    raise_on_sigterm()

    from lamina.model.loader import load_tokenizer, resolve_checkpoint

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
          f"prompts (token ids), exactly {args.output_tokens} output tokens each (ignore_eos), greedy", flush=True)

    binary, llama_version, llama_why = find_llama_server(args.skip_llama, "llama.cpp row")

    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="cpu-anchor-") as tmp:
        log_dir = Path(tmp)
        try:
            if binary is not None:
                r = run_llama_server(binary, gguf, prompts, args.output_tokens, args.llama_threads, log_dir)
                rows.append({"system": "llama_cpp", "name": f"llama-server, {args.llama_threads} threads, "
                             f"{args.requests} slots", **r})
                print(f"  llama-server: {r['tok_s']:.1f} tok/s", flush=True)
            for w in weights_list:
                for t in up_threads:
                    r = run_lamina_up(w, prompts, args.output_tokens, log_dir, t)
                    name = f"lamina up, weights {w}" + (f", --model-threads {t}" if t is not None else "")
                    rows.append({"system": "lamina_up", "weights": w, "model_threads": t, "name": name, **r})
                    print(f"  {name}: {r['tok_s']:.1f} tok/s", flush=True)
            for w in weights_list:
                for threads, r in run_engine(w, prompts, args.output_tokens, engine_threads).items():
                    rows.append({"system": "local_engine", "weights": w, "threads": threads,
                                 "name": f"local engine, weights {w}, {threads} thread(s)", **r})
        except KeyboardInterrupt:
            print("interrupted: every process started here was stopped", file=sys.stderr)
            raise SystemExit(130) from None

    load_after = os.getloadavg()
    llama = next((r["tok_s"] for r in rows if r["system"] == "llama_cpp"), None)
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in load_after)}")
    print(f"{'system':44s} {'tok/s':>8s} {'seconds':>8s}  {'vs llama.cpp':>12s}  prompt tokens")
    for r in rows:
        ratio = f"{r['tok_s'] / llama:11.2f}x" if llama else f"{'-':>12s}"
        print(f"{r['name']:44s} {r['tok_s']:8.1f} {r['seconds']:8.1f}  {ratio}  {r['prompt_tokens']}")

    first = weights_list[0] if weights_list else None
    # The target is lamina up as a user starts it: its defaults (or the first --up-model-threads).
    up = next((r["tok_s"] for r in rows if r["system"] == "lamina_up" and r["weights"] == first), None)
    up_by_threads = {str(r["model_threads"] or "default"): r["tok_s"] for r in rows
                     if r["system"] == "lamina_up" and r["weights"] == first}
    local = {r["threads"]: r["tok_s"] for r in rows if r["system"] == "local_engine" and r["weights"] == first}
    best_local = max(local.values()) if local else None
    targets = {}
    if llama:
        if best_local is not None:
            targets["local engine >= 1.0x llama.cpp"] = best_local >= llama
        if up is not None:
            targets["lamina up >= 0.8x llama.cpp"] = up >= 0.8 * llama
        for name, ok in targets.items():
            print(f"target {name} ({first}): {'met' if ok else 'MISSED'}")
    print(json.dumps({
        "llama_cpp_tok_s": llama, "lamina_up_tok_s": up, "local_engine_tok_s": best_local,
        "local_engine_tok_s_by_threads": local, "lamina_up_tok_s_by_model_threads": up_by_threads,
        "weights": first,
        "lamina_up_vs_llama_cpp": up / llama if llama and up else None,
        "local_engine_vs_llama_cpp": best_local / llama if llama and best_local else None,
        "targets": targets, "llama_cpp_unavailable": llama_why, "llama_server_version": llama_version,
        "workload": {"requests": args.requests, "prompt_tokens": args.prompt_tokens,
                     "output_tokens": args.output_tokens, "llama_threads": args.llama_threads},
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "load_before": load_before,
                    "load_after": load_after},
        "commit": commit,
        "rows": [{k: v for k, v in r.items() if k != "argv"} for r in rows],
    }))


if __name__ == "__main__":
    main()
