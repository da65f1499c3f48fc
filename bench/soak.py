"""Soak test: many mixed requests against one stack; nothing may leak, hang or fail unexpectedly.

Workload (seeded, --seed): --requests requests (default 1,000) at most --concurrency (16)
at a time, after --warmup (50) requests of the same mix. Each request is one of:
- chat_stream: streaming chat through the official `openai` client (AsyncOpenAI);
- completion: non-streaming completion through the same client;
- stop: a chat or completion (streaming or not) with stop strings; the text must not
  hold one;
- cancel: a streaming chat over aiohttp whose client closes the connection after 0-3
  events (0: right after the response headers);
- overlong: a prompt longer than the context (text, or token ids), or max_tokens past
  it; must be a 400 with code context_length_exceeded.
Generated lengths are small (max_tokens 4..24) so the default run takes about 10 minutes
on 2 shared cores. Every request has a client deadline (--timeout); one that passes it
has hung.

It starts the stack itself (embedded Redis and every service in its own process, as
`lamina up` does) unless --base-url names a running stack on this host (found by its
port, as `lamina status --port` does, or through --config). Before (after the warm-up,
once the stack is idle) and after (once idle again) it reads every service's RSS
(/proc/PID/status VmRSS; RssAnon, its anonymous part, where a leak shows, is printed too:
file-backed pages such as mapped weights come and go with the page cache) and open
descriptors (/proc/PID/fd), Redis included.

Passes when: every request ended (none lost, none past its deadline); no unexpected
error (anything but the over-long requests' 400s, or an output that breaks the API's
promises); every attention worker holds 0 tokens and the scheduler runs and queues
nothing once idle; no service was restarted (same pids); and for every process
RSS_after <= 1.10 x RSS_warm (--tolerance), descriptors other than connections to Redis
after <= ceil(1.10 x warm), and connections to Redis (a pool grows to the peak of concurrent
calls) after <= warm + --concurrency (for Redis itself: that per other process).
Prints the workload, the machine, each process's figures, errors by kind, latency p50/p99,
and as its last line one JSON object with a "pass" boolean; exits 1 when it fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import platform
import random
import signal
import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlparse

log = logging.getLogger("soak")

KIND_WEIGHTS = {"chat_stream": 0.35, "completion": 0.25, "stop": 0.17, "cancel": 0.13, "overlong": 0.10}
TOPICS = ["the sea", "a red bicycle", "prime numbers", "the moon", "bread", "rain in spring", "a quiet library",
          "mountains", "a lost key", "coffee", "trains at night", "honey bees", "old maps", "the colour blue"]
CHAT_FORMS = ["Write one sentence about {t}.", "Tell me a fact about {t}.", "What is {t}?",
              "Describe {t} in a few words.", "Give me a short list of words about {t}."]
COMPLETION_FORMS = ["The story of {t} begins", "A short note on {t}:", "Q: What do you know about {t}?\nA:",
                    "Here are three things about {t}: 1."]
FILLER = ["and", "then", "it", "went", "on", "over", "the", "hill", "under", "a", "grey", "sky", "while", "people",
          "talked", "about", "it"]
CACHE_BYTES = 16 << 20  # each prefix-cache tier of the stack started here
STOPS = [["."], ["\n"], [" the"], [",", "!"], [" a ", "."]]


@dataclass(frozen=True)
class Spec:
    index: int
    kind: str
    text: str
    max_tokens: int
    stream: bool = True
    chat: bool = True
    stop: list[str] | None = None
    cancel_after: int = 0  # cancel: events read before the client closes
    overlong: str = ""  # overlong: "text", "ids" or "max_tokens"


@dataclass
class Outcome:
    kind: str
    error: str | None = None  # None: as expected
    expected_400: bool = False
    latency_s: float | None = None  # finished requests only
    ttft_s: float | None = None


def make_workload(n: int, seed: int, offset: int = 0) -> list[Spec]:
    rng = random.Random(seed)
    kinds, weights = list(KIND_WEIGHTS), list(KIND_WEIGHTS.values())
    specs = []
    for i in range(offset, offset + n):
        kind = rng.choices(kinds, weights)[0]
        chat = kind in ("chat_stream", "cancel") or (kind != "completion" and rng.random() < 0.5)
        form = rng.choice(CHAT_FORMS if chat else COMPLETION_FORMS).format(t=rng.choice(TOPICS))
        text = form + "".join(" " + rng.choice(FILLER) for _ in range(rng.choice([0, 0, 4, 16, 48])))
        specs.append(Spec(i, kind, text, rng.randint(4, 24), stream=kind in ("chat_stream", "cancel")
                          or (kind in ("stop", "overlong") and rng.random() < 0.5), chat=chat,
                          stop=rng.choice(STOPS) if kind == "stop" else None, cancel_after=rng.randint(0, 3),
                          overlong=rng.choice(["text", "ids", "max_tokens"]) if kind == "overlong" else ""))
    return specs


class Client:
    """The HTTP clients of one run: AsyncOpenAI for normal requests, aiohttp for cancels."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float, concurrency: int) -> None:
        import aiohttp
        import openai

        self.base_url = base_url
        self.timeout_s = timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.openai = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=api_key or "unused", max_retries=0,
                                         timeout=timeout_s)
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                          connector=aiohttp.TCPConnector(limit=concurrency))
        self.model = ""
        self.max_model_len = 0

    async def discover(self) -> None:
        async with self.http.get(self.base_url + "/v1/models", headers=self.headers) as r:
            entry = (await r.json())["data"][0]
        self.model, self.max_model_len = entry["id"], int(entry.get("max_model_len") or 8192)

    async def close(self) -> None:
        await self.openai.close()
        await self.http.close()

    async def run(self, spec: Spec) -> Outcome:
        """One request within the client deadline; every failure becomes an Outcome."""
        import aiohttp
        import openai

        start = time.perf_counter()
        out = Outcome(spec.kind)
        try:
            async with asyncio.timeout(self.timeout_s + 5):  # total, also for a stream that trickles
                if spec.kind == "cancel":
                    await self._cancel(spec)
                elif spec.kind == "overlong":
                    out = await self._overlong(spec)
                else:
                    out.ttft_s = await self._normal(spec, start)
                    out.latency_s = time.perf_counter() - start
        except TimeoutError:
            out.error = "timeout (hung)"
        except openai.APIStatusError as exc:
            out.error = f"HTTP {exc.status_code} {_code(exc.body)}"
        except openai.APIError as exc:  # connection errors, errors sent inside a stream
            out.error = f"{type(exc).__name__}: {str(exc)[:80]}"
        except (aiohttp.ClientError, OSError) as exc:
            out.error = f"{type(exc).__name__}: {str(exc)[:80]}"
        except BadOutput as exc:
            out.error = f"bad output: {exc}"
        return out

    async def _normal(self, spec: Spec, start: float) -> float | None:
        common = dict(model=self.model, max_tokens=spec.max_tokens, temperature=0.7, seed=spec.index,
                      stop=spec.stop)
        if spec.chat:
            call = self.openai.chat.completions.create(messages=[{"role": "user", "content": spec.text}],
                                                       **common, **_stream_args(spec.stream))
        else:
            call = self.openai.completions.create(prompt=spec.text, **common, **_stream_args(spec.stream))
        resp = await call
        if not spec.stream:
            choice = resp.choices[0]
            text = choice.message.content if spec.chat else choice.text
            _check(spec, text or "", choice.finish_reason, resp.usage.completion_tokens)
            return None
        parts, finish, usage, ttft = [], None, None, None
        async for chunk in resp:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            piece = (choice.delta.content if spec.chat else choice.text) or ""
            if piece and ttft is None:
                ttft = time.perf_counter() - start
            parts.append(piece)
            finish = choice.finish_reason or finish
        _check(spec, "".join(parts), finish, usage)
        return ttft

    async def _cancel(self, spec: Spec) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": spec.text}],
                "max_tokens": spec.max_tokens, "temperature": 0.7, "seed": spec.index, "stream": True}
        resp = await self.http.post(self.base_url + "/v1/chat/completions", json=body, headers=self.headers)
        try:
            if resp.status != 200:
                raise BadOutput(f"cancelled stream got HTTP {resp.status}")
            events = 0
            while events < spec.cancel_after:
                line = await resp.content.readline()
                if not line or line.strip() == b"data: [DONE]":
                    break  # ended before the client closed it: fine, nothing to cancel
                events += line.startswith(b"data: ")
        finally:
            resp.close()  # closes the connection: the gateway must abort the request

    async def _overlong(self, spec: Spec) -> Outcome:
        n = self.max_model_len + 64
        body: dict = {"model": self.model, "max_tokens": spec.max_tokens, "stream": spec.stream}
        param_text = " hello" * n  # " hello" is one token in SmolLM2's vocabulary; n of them pass the context
        if spec.overlong == "max_tokens":
            body["max_tokens"] = self.max_model_len
        if spec.chat:  # token ids are a completions prompt: a chat's "ids" case sends the long text
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": spec.text if spec.overlong == "max_tokens" else param_text}]
        else:
            path = "/v1/completions"
            body["prompt"] = {"text": param_text, "ids": [42] * n}.get(spec.overlong, spec.text)
        async with self.http.post(self.base_url + path, json=body, headers=self.headers) as r:
            payload = await r.read()
        try:
            code = json.loads(payload)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = None
        if r.status == 400 and code == "context_length_exceeded":
            return Outcome(spec.kind, expected_400=True)
        return Outcome(spec.kind, error=f"over-long ({spec.overlong}) got HTTP {r.status} {code}")


class BadOutput(Exception):
    pass


def _stream_args(stream: bool) -> dict:
    return {"stream": True, "stream_options": {"include_usage": True}} if stream else {}


def _code(body) -> str:
    return str(body.get("code") or body.get("error", {}).get("code")) if isinstance(body, dict) else ""


def _check(spec: Spec, text: str, finish: str | None, completion_tokens: int | None) -> None:
    """What docs/api.md promises of a finished request."""
    if finish not in ("stop", "length"):
        raise BadOutput(f"finish_reason {finish!r}")
    if completion_tokens is None or not 1 <= completion_tokens <= spec.max_tokens:
        raise BadOutput(f"completion_tokens {completion_tokens} for max_tokens {spec.max_tokens}")
    if finish == "length" and completion_tokens != spec.max_tokens:
        raise BadOutput(f"finish 'length' after {completion_tokens} of {spec.max_tokens} tokens")
    for s in spec.stop or ():
        if s in text:
            raise BadOutput(f"stop string {s!r} in the text")


async def run_batch(client: Client, specs: list[Spec], concurrency: int) -> list[Outcome]:
    gate = asyncio.Semaphore(concurrency)

    async def one(spec: Spec) -> Outcome:
        async with gate:
            try:
                return await client.run(spec)
            except Exception as exc:  # a bug here must not take the other requests with it
                log.exception("request %d (%s): client failure", spec.index, spec.kind)  # the traceback, on stderr
                return Outcome(spec.kind, error=f"client failure {type(exc).__name__}: {str(exc)[:80]}")

    return await asyncio.gather(*(one(s) for s in specs))


# ---- the stack's processes and state ----

@dataclass
class Snapshot:
    processes: dict[str, dict] = field(default_factory=dict)  # name -> pid, rss_kib, fds
    kv_tokens: list[int] = field(default_factory=list)  # per attention worker
    running: int | None = None
    waiting: int | None = None
    redis_keys: set[str] = field(default_factory=set)  # the keys in the stack's namespace


def tcp_ports() -> dict[str, tuple[int, int]]:
    """socket inode -> (local port, remote port) of every TCP socket in this network namespace."""
    ports = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(name) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                ports[cols[9]] = (int(cols[1].rsplit(":", 1)[1], 16), int(cols[2].rsplit(":", 1)[1], 16))
    return ports


def proc_figures(pid: int, redis_port: int, ports: dict[str, tuple[int, int]]) -> dict:
    """RSS, open descriptors, and how many of them are connections to Redis (or, for Redis,
    from its clients)."""
    mem = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                mem[key] = int(value.split()[0])
    fds, redis_conns = 0, 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        fds += 1
        local, remote = ports.get(target[len("socket:["):-1], (0, 0)) if target.startswith("socket:[") else (0, 0)
        redis_conns += remote == redis_port or (local == redis_port and remote != 0)
    return {"pid": pid, "rss_kib": mem["VmRSS"], "anon_kib": mem["RssAnon"], "fds": fds, "redis_conns": redis_conns}


async def snapshot(config) -> Snapshot:
    import redis.asyncio as aioredis

    from lamina.services.cluster_status import read_status

    status = await read_status(config)
    snap = Snapshot(kv_tokens=[a.num_tokens if a.num_tokens is not None else -1 for a in status.attention],
                    running=status.running, waiting=status.waiting)
    here, redis_port, ports = socket.gethostname(), urlparse(config.redis_url).port, tcp_ports()
    for s in status.services:
        if s.pid is not None and s.host == here:
            snap.processes[s.name] = proc_figures(s.pid, redis_port, ports)
    r = aioredis.from_url(config.redis_url)
    try:
        snap.processes["redis"] = proc_figures(int((await r.info("server"))["process_id"]), redis_port, ports)
        snap.redis_keys = {k.decode() async for k in r.scan_iter(match=f"{config.namespace}:*", count=1000)}
    finally:
        await r.aclose()
    return snap


async def wait_idle(config, timeout_s: float) -> Snapshot:
    """The stack's snapshot once no request runs or waits and no KV is held (or at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        snap = await snapshot(config)
        idle = snap.running == 0 and snap.waiting == 0 and snap.kv_tokens and all(t == 0 for t in snap.kv_tokens)
        if idle or time.monotonic() >= deadline:
            return snap
        await asyncio.sleep(0.5)  # polling other processes' state: there is no event to wait on


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


# ---- the run ----

async def run_with_client(args, base_url: str, config, specs: list[Spec]) -> list[Outcome]:
    client = Client(base_url, config.gateway.api_key, args.timeout, args.concurrency)
    try:
        await client.discover()
        return await run_batch(client, specs, args.concurrency)
    finally:
        await client.close()


async def soak(args, base_url: str, config) -> dict:
    # One client for the warm-up and another for the run, each closed before the stack is
    # measured: its pooled connections would count as the gateway's descriptors.
    warm = await run_with_client(args, base_url, config, make_workload(args.warmup, args.seed + 1))
    warm_errors = Counter(o.error for o in warm if o.error)
    print(f"warm-up: {len(warm)} requests, unexpected errors {dict(warm_errors) or 'none'}", flush=True)
    before = await wait_idle(config, args.idle_timeout)
    specs = make_workload(args.requests, args.seed)
    print(f"mix: {dict(sorted(Counter(s.kind for s in specs).items()))}", flush=True)
    start = time.perf_counter()
    outcomes = await run_with_client(args, base_url, config, specs)
    elapsed = time.perf_counter() - start
    after = await wait_idle(config, args.idle_timeout)
    return judge(args, specs, outcomes, elapsed, before, after, warm_errors)


def judge(args, specs: list[Spec], outcomes: list[Outcome], elapsed: float, before: Snapshot,
          after: Snapshot, warm_errors: Counter) -> dict:
    tol = args.tolerance
    errors = Counter(o.error for o in outcomes if o.error)
    hung = sum(1 for o in outcomes if o.error == "timeout (hung)")
    lost = len(specs) - len(outcomes)
    latencies = [o.latency_s for o in outcomes if o.latency_s is not None]
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    procs, grown = {}, []
    for name, b in before.processes.items():
        a = after.processes.get(name)
        procs[name] = {f"{k}_{when}": (x or {}).get(k) for k in ("rss_kib", "anon_kib", "fds", "redis_conns")
                       for when, x in (("warm", b), ("after", a))}
        procs[name]["pid"] = b["pid"]
        if a is None or a["pid"] != b["pid"]:
            grown.append(f"{name}: restarted or gone")
            continue
        other_b, other_a = b["fds"] - b["redis_conns"], a["fds"] - a["redis_conns"]
        if a["rss_kib"] > tol * b["rss_kib"]:
            grown.append(f"{name}: RSS {b['rss_kib']} -> {a['rss_kib']} KiB")
        if other_a > math.ceil(tol * other_b):
            grown.append(f"{name}: descriptors other than Redis connections {other_b} -> {other_a}")
        allowance = args.concurrency * (len(before.processes) - 1 if name == "redis" else 1)
        if a["redis_conns"] > b["redis_conns"] + allowance:
            grown.append(f"{name}: Redis connections {b['redis_conns']} -> {a['redis_conns']}")
    kv_zero = bool(after.kv_tokens) and all(t == 0 for t in after.kv_tokens)
    idle = after.running == 0 and after.waiting == 0
    ok = lost == 0 and hung == 0 and not errors and not warm_errors and kv_zero and idle and not grown and bool(procs)
    return {
        "requests": len(specs), "concurrency": args.concurrency, "seed": args.seed, "seconds": round(elapsed, 1),
        "requests_per_s": round(len(specs) / elapsed, 2),
        "mix": dict(sorted(Counter(s.kind for s in specs).items())),
        "expected_400": sum(o.expected_400 for o in outcomes), "unexpected_errors": dict(errors),
        "warmup_unexpected_errors": dict(warm_errors),
        "errors_by_request_kind": dict(Counter(o.kind for o in outcomes if o.error)),
        "lost": lost, "hung": hung,
        "latency_s": {"p50": _round(pct(latencies, 0.5)), "p99": _round(pct(latencies, 0.99)), "n": len(latencies)},
        "ttft_s": {"p50": _round(pct(ttfts, 0.5)), "p99": _round(pct(ttfts, 0.99)), "n": len(ttfts)},
        "kv_tokens_after": after.kv_tokens, "running_after": after.running, "waiting_after": after.waiting,
        "redis_keys": {"warm": len(before.redis_keys), "after": len(after.redis_keys),
                       "new": sorted(after.redis_keys - before.redis_keys)[:10]},
        "processes": procs, "over_tolerance": grown,
        "tolerance": f"per process: RSS_after <= {tol:.2f} x RSS_warm; descriptors other than Redis connections: "
                     f"after <= ceil({tol:.2f} x warm); Redis connections: after <= warm + concurrency "
                     f"({args.concurrency}; for Redis itself, concurrency x its clients), as a connection pool "
                     f"grows to the peak of concurrent calls",
        "pass": ok,
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def report(result: dict) -> None:
    print(f"\n{result['requests']} requests in {result['seconds']} s ({result['requests_per_s']} req/s)")
    print(f"{'process':<14}{'pid':>8}{'RSS warm':>14}{'RSS after':>14}{'ratio':>8}{'anon warm':>14}{'anon after':>14}"
          f"{'fds warm':>10}{'fds after':>10}   (of which Redis connections)")
    for name, p in result["processes"].items():
        ratio = p["rss_kib_after"] / p["rss_kib_warm"] if p["rss_kib_after"] and p["rss_kib_warm"] else float("nan")
        print(f"{name:<14}{p['pid']:>8}{p['rss_kib_warm']:>10} KiB{p['rss_kib_after'] or 0:>10} KiB{ratio:>8.3f}"
              f"{p['anon_kib_warm']:>10} KiB{p['anon_kib_after'] or 0:>10} KiB"
              f"{p['fds_warm']:>10}{p['fds_after'] or 0:>10}   ({p['redis_conns_warm']} -> {p['redis_conns_after']})")
    print(f"KV tokens per attention worker once idle: {result['kv_tokens_after']} "
          f"(scheduler running {result['running_after']}, waiting {result['waiting_after']})")
    keys = result["redis_keys"]
    print(f"Redis keys in the namespace: {keys['warm']} after warm-up, {keys['after']} after; new: {keys['new']}")
    print(f"expected 400s (over-long): {result['expected_400']}; unexpected errors: "
          f"{result['unexpected_errors'] or 'none'}; lost {result['lost']}, hung {result['hung']}")
    lat, ttft = result["latency_s"], result["ttft_s"]
    print(f"latency of finished requests p50 {lat['p50']} s, p99 {lat['p99']} s (n={lat['n']}); "
          f"streams' TTFT p50 {ttft['p50']} s, p99 {ttft['p99']} s")
    print(f"tolerance: {result['tolerance']}; over it: {result['over_tolerance'] or 'none'}")
    print("PASS" if result["pass"] else "FAIL")
    print(json.dumps(result))


def find_config(base_url: str, config_path: str | None):
    from lamina.services.config import load_config
    from lamina.services.launch import local_stacks

    path = config_path or local_stacks.find(urlparse(base_url).port or 80)
    if path is None:
        raise SystemExit(f"no stack started on this host answers at {base_url}; pass its --config")
    return load_config(path)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0, help="client deadline per request (s)")
    ap.add_argument("--idle-timeout", type=float, default=60.0, help="how long to wait for the stack to be idle (s)")
    ap.add_argument("--tolerance", type=float, default=1.10, help="allowed growth factor of RSS and fds")
    ap.add_argument("--base-url", default=None, help="a running stack on this host (default: start one)")
    ap.add_argument("--config", default=None, help="that stack's configuration file (default: found by its port)")
    args = ap.parse_args()

    # SIGTERM stops the run as Ctrl-C does: the finally below stops every process started here.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    print(f"soak: {args.requests} requests (+{args.warmup} warm-up), concurrency {args.concurrency}, seed "
          f"{args.seed}, max_tokens 4..24, mix weights {KIND_WEIGHTS}, client deadline {args.timeout:.0f} s")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}, {platform.python_implementation()} "
          f"{platform.python_version()}", flush=True)
    stack = None
    try:
        if args.base_url:
            base_url, config = args.base_url.rstrip("/"), find_config(args.base_url, args.config)
        else:
            from lamina.kvstore.redis_server import free_tcp_port
            from lamina.services.config import GatewaySection, PrefillSection, StackConfig
            from lamina.services.launch.launcher import Stack

            # A small prefix cache, full after the warm-up: the default one (256 + 512 MiB)
            # would grow the prefill worker's RSS by design for the whole run.
            stack = Stack(StackConfig(gateway=GatewaySection(port=free_tcp_port()),
                                      prefill=PrefillSection(cache_device_bytes=CACHE_BYTES,
                                                             cache_host_bytes=CACHE_BYTES)))
            print("starting the stack (defaults: 2 attention workers, 1 model worker, tcp; prefix cache 16 + 16 "
                  "MiB)...", flush=True)
            t0 = time.perf_counter()
            stack.start()
            print(f"stack up in {time.perf_counter() - t0:.0f} s at {stack.base_url}; logs in {stack.log_dir}",
                  flush=True)
            base_url, config = stack.base_url, stack.config
        result = asyncio.run(soak(args, base_url, config))
    except KeyboardInterrupt as exc:
        print(f"interrupted ({exc or 'Ctrl-C'}); stopping what was started", flush=True)
        result = None
    finally:
        if stack is not None:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the stop short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            stack.stop()
    if result is None:
        return 130
    report(result)
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
