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

--hosts (root; iproute2) runs the same mix on the cluster of tests/cluster: Redis and every
service on a network namespace of its own (two model and two attention workers), the
client on the gateway's host. Every --partition-every s (30) the cluster is split in two
for --partition-s (10): model-1 and attention-1 on one side, everything else on the other.
Prompts and lengths come from a small pool (--pool of each kind, max_tokens 8, 16 or 24)
and normal requests are greedy, so each one's text is known from a reference pass on the
healthy cluster before the warm-up: a finished request must equal it (cut at its stop
string). A request may then also end with a clear error (an HTTP 5xx with an error code,
or an error event in the stream), counted apart; anything else fails the run as above.
After each heal it measures how long until a request sent after the heal completes, until
every service is registered and healthy, and until model-1 and attention-1 work again
(their step and frame counters grow), and reports median and worst; the run also fails
when a partition is not recovered from within --recovery-timeout or the scheduler rebuilt
nothing (the partitions cut off no work).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
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
    # The error names its cause (an HTTP error with a code, or an error event inside the
    # stream): what a request cut off by a partition may end with (--hosts).
    clear: bool = False
    expected_400: bool = False
    latency_s: float | None = None  # finished requests only
    ttft_s: float | None = None


def make_text(rng: random.Random, chat: bool) -> str:
    form = rng.choice(CHAT_FORMS if chat else COMPLETION_FORMS).format(t=rng.choice(TOPICS))
    return form + "".join(" " + rng.choice(FILLER) for _ in range(rng.choice([0, 0, 4, 16, 48])))


@dataclass(frozen=True)
class Pool:
    """A few prompts and lengths that every request draws from (--hosts: each distinct
    greedy request's output is known before the faults start)."""
    chat: tuple[str, ...]
    completion: tuple[str, ...]
    max_tokens: tuple[int, ...] = (8, 16, 24)

    @classmethod
    def make(cls, seed: int, size: int) -> Pool:
        rng = random.Random(seed)
        return cls(tuple(make_text(rng, True) for _ in range(size)), tuple(make_text(rng, False) for _ in range(size)))


def make_workload(n: int, seed: int, offset: int = 0, pool: Pool | None = None) -> list[Spec]:
    rng = random.Random(seed)
    kinds, weights = list(KIND_WEIGHTS), list(KIND_WEIGHTS.values())
    specs = []
    for i in range(offset, offset + n):
        kind = rng.choices(kinds, weights)[0]
        chat = kind in ("chat_stream", "cancel") or (kind != "completion" and rng.random() < 0.5)
        if pool is None:
            text, max_tokens = make_text(rng, chat), rng.randint(4, 24)
        else:
            text, max_tokens = rng.choice(pool.chat if chat else pool.completion), rng.choice(pool.max_tokens)
        specs.append(Spec(i, kind, text, max_tokens, stream=kind in ("chat_stream", "cancel")
                          or (kind in ("stop", "overlong") and rng.random() < 0.5), chat=chat,
                          stop=rng.choice(STOPS) if kind == "stop" else None, cancel_after=rng.randint(0, 3),
                          overlong=rng.choice(["text", "ids", "max_tokens"]) if kind == "overlong" else ""))
    return specs


Key = tuple[bool, str, int]  # chat, text, max_tokens: what a greedy request's output depends on


def key(spec: Spec) -> Key:
    return spec.chat, spec.text, spec.max_tokens


def expected_text(reference: str, stop: list[str] | None) -> str:
    """A greedy request's text given the same request's text without stop strings: cut
    before the first stop string."""
    cuts = [i for i in (reference.find(s) for s in stop or ()) if i >= 0]
    return reference[:min(cuts)] if cuts else reference


class Client:
    """The HTTP clients of one run: AsyncOpenAI for normal requests, aiohttp for cancels.
    With `references` (--hosts), normal requests are greedy and each text must equal its
    reference's."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float, concurrency: int,
                 references: dict[Key, str] | None = None) -> None:
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
        self.references = references

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
            out.clear = exc.status_code >= 500 and _code(exc.body) not in ("", "None")
        except (openai.APIConnectionError, openai.APITimeoutError) as exc:  # the gateway itself unreachable
            out.error = f"{type(exc).__name__}: {str(exc)[:80]}"
        except openai.APIError as exc:  # an error event inside a stream
            out.error = f"{type(exc).__name__}: {str(exc)[:80]}"
            out.clear = bool(exc.message)
        except ClearError as exc:
            out.error, out.clear = str(exc), True
        except (aiohttp.ClientError, OSError) as exc:
            out.error = f"{type(exc).__name__}: {str(exc)[:80]}"
        except BadOutput as exc:
            out.error = f"bad output: {exc}"
        return out

    async def _normal(self, spec: Spec, start: float) -> float | None:
        greedy = self.references is not None
        common = dict(model=self.model, max_tokens=spec.max_tokens, temperature=0.0 if greedy else 0.7,
                      seed=spec.index, stop=spec.stop)
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
            self._exact(spec, text or "")
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
        self._exact(spec, "".join(parts))
        return ttft

    def _exact(self, spec: Spec, text: str) -> None:
        if self.references is None or key(spec) not in self.references:
            return
        want = expected_text(self.references[key(spec)], spec.stop)
        if text != want:
            raise BadOutput(f"not exact: {text[:40]!r} where the reference has {want[:40]!r}")

    async def reference(self, k: Key) -> str:
        """The greedy text of one request without stop strings (non-streaming)."""
        chat, text, max_tokens = k
        if chat:
            resp = await self.openai.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0)
            return resp.choices[0].message.content or ""
        done = await self.openai.completions.create(model=self.model, prompt=text, max_tokens=max_tokens,
                                                    temperature=0)
        return done.choices[0].text

    async def _cancel(self, spec: Spec) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": spec.text}],
                "max_tokens": spec.max_tokens, "temperature": 0.7, "seed": spec.index, "stream": True}
        resp = await self.http.post(self.base_url + "/v1/chat/completions", json=body, headers=self.headers)
        try:
            if resp.status >= 500 and self.references is not None and \
                    (code := _code(await _json(resp))) not in ("", "None"):
                raise ClearError(f"HTTP {resp.status} {code}")
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


class ClearError(Exception):
    """An error response that names its cause."""


async def _json(resp) -> object:
    try:
        return await resp.json(content_type=None)
    except ValueError:
        return None


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


def tcp_ports(pid: int) -> dict[str, tuple[int, int]]:
    """socket inode -> (local port, remote port) of every TCP socket in process `pid`'s
    network namespace (with --hosts, each service has its own)."""
    ports = {}
    for name in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        with open(name) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                ports[cols[9]] = (int(cols[1].rsplit(":", 1)[1], 16), int(cols[2].rsplit(":", 1)[1], 16))
    return ports


def status_kib(pid: int, keys: tuple[str, ...] = ("VmRSS", "RssAnon")) -> dict[str, int]:
    """Those fields of /proc/PID/status (KiB)."""
    mem = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in keys:
                mem[key] = int(value.split()[0])
    return mem


def proc_figures(pid: int, redis_port: int) -> dict:
    """RSS, open descriptors, and how many of them are connections to Redis (or, for Redis,
    from its clients)."""
    ports = tcp_ports(pid)
    mem = status_kib(pid)
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
    here, redis_port = socket.gethostname(), urlparse(config.redis_url).port
    for s in status.services:
        if s.pid is not None and s.host == here:
            snap.processes[s.name] = proc_figures(s.pid, redis_port)
    r = aioredis.from_url(config.redis_url)
    try:
        snap.processes["redis"] = proc_figures(int((await r.info("server"))["process_id"]), redis_port)
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

async def run_with_client(args, base_url: str, config, specs: list[Spec],
                          references: dict[Key, str] | None = None) -> list[Outcome]:
    client = Client(base_url, config.gateway.api_key, args.timeout, args.concurrency, references)
    try:
        await client.discover()
        return await run_batch(client, specs, args.concurrency)
    finally:
        await client.close()


async def make_references(args, base_url: str, config, pool: Pool) -> dict[Key, str]:
    """Every distinct greedy request of the pool, once, on the healthy cluster."""
    keys = [(chat, text, n) for chat, texts in ((True, pool.chat), (False, pool.completion)) for text in texts
            for n in pool.max_tokens]
    client = Client(base_url, config.gateway.api_key, args.timeout, args.concurrency)
    gate = asyncio.Semaphore(args.concurrency)

    async def one(k: Key) -> str:
        async with gate:
            return await client.reference(k)

    try:
        await client.discover()
        return dict(zip(keys, await asyncio.gather(*(one(k) for k in keys))))
    finally:
        await client.close()


@dataclass
class Partition:
    cut_at_s: float  # into the run
    cut_s: float
    serving_after_s: float | None = None  # heal -> the first request sent after it completed
    whole_after_s: float | None = None  # heal -> every service registered and healthy again
    # heal -> both workers of the far side did work again (None: not before the run ended)
    rejoined_after_s: float | None = None
    rss_mib: dict[str, int] = field(default_factory=dict)  # each service's RSS once recovered


REBUILDS = "lamina_scheduler_rebuilds_total"
RECLAIMED = "lamina_scheduler_kv_reclaimed_total"
FAR_WORK = {"model-1": "lamina_model_steps_total", "attention-1": "lamina_attention_frames_total"}


async def partitions(args, stack, start: float, stop: asyncio.Event) -> list[Partition]:
    """Split the cluster for --partition-s every --partition-every s until `stop`; after
    each heal, how long until the cluster serves again, until every service is back, and
    until the far side's workers work again."""
    hosts, done = stack.hosts, []
    while True:
        try:
            await asyncio.wait_for(stop.wait(), args.partition_every - args.partition_s)
            return done
        except TimeoutError:
            pass
        cut_at = time.perf_counter()
        hosts.split()
        try:
            await asyncio.sleep(args.partition_s)
        finally:
            hosts.join()
        healed = time.perf_counter()
        part = Partition(round(cut_at - start, 1), round(healed - cut_at, 1))
        done.append(part)
        await recovery(args, stack, healed, part, stop)
        part.rss_mib = {sp.name: status_kib(sp.proc.pid, ("VmRSS",))["VmRSS"] >> 10 for sp in stack.processes
                        if sp.proc is not None}
        print(f"partition {len(done)} at {part.cut_at_s} s for {part.cut_s} s, after the heal: serving "
              f"{part.serving_after_s} s, every service back {part.whole_after_s} s, far side working "
              f"{part.rejoined_after_s} s; RSS MiB {part.rss_mib}", flush=True)


async def recovery(args, stack, healed: float, part: Partition, stop: asyncio.Event) -> None:
    """Probe (a 2-token greedy completion every 0.5 s, the cluster's status, the far side's
    work counters) until the recovery times are known, --recovery-timeout passes, or (for
    the far side's work) the run ends."""
    import openai

    from lamina.kvstore.metadata import REDIS_ERRORS
    from lamina.services.cluster_status import read_status

    config, num_services = stack.config, len(stack.processes)
    client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=config.gateway.api_key or "unused",
                                max_retries=0, timeout=args.recovery_timeout)

    async def far_work() -> list[float | None]:
        from redis.exceptions import RedisError

        async def one(name: str, metric: str) -> float | None:
            try:
                return await asyncio.to_thread(stack.metric, name, metric)
            except (AssertionError, OSError, RedisError):  # not registered or not answering yet
                return None
        return list(await asyncio.gather(*(one(n, m) for n, m in FAR_WORK.items())))

    at_heal = await far_work()
    model = (await client.models.list()).data[0].id

    async def probe() -> None:
        with contextlib.suppress(openai.APIError):
            await client.completions.create(model=model, prompt="Hello", max_tokens=2, temperature=0)
            if part.serving_after_s is None:
                part.serving_after_s = round(time.perf_counter() - healed, 2)

    probes: set[asyncio.Task] = set()
    try:
        while part.serving_after_s is None or part.whole_after_s is None or \
                (part.rejoined_after_s is None and not stop.is_set()):
            if time.perf_counter() - healed > args.recovery_timeout:
                return
            if part.rejoined_after_s is None and not stop.is_set():
                now = await far_work()
                if all(a is not None and b is not None and b > a for a, b in zip(at_heal, now)):
                    part.rejoined_after_s = round(time.perf_counter() - healed, 2)
                at_heal = [b if a is None else a for a, b in zip(at_heal, now)]
            if part.serving_after_s is None:
                task = asyncio.create_task(probe())
                probes.add(task)
                task.add_done_callback(probes.discard)
            if part.whole_after_s is None:
                try:
                    status = await asyncio.wait_for(read_status(config), 5)
                except (TimeoutError, *REDIS_ERRORS) as exc:  # Redis not answering yet
                    log.debug("cluster status not read: %s", exc)
                else:
                    if len(status.services) == num_services and all(s.healthy for s in status.services):
                        part.whole_after_s = round(time.perf_counter() - healed, 2)
            await asyncio.sleep(0.5)  # probing other processes' state: nothing here to wait on
    finally:
        for task in probes:
            task.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        await client.close()


async def soak(args, base_url: str, config, stack=None) -> dict:
    """The run; `stack` (a HostsStack): --hosts."""
    pool = references = None
    if stack is not None:
        pool = Pool.make(args.seed + 2, args.pool)
        t0 = time.perf_counter()
        references = await make_references(args, base_url, config, pool)
        print(f"references: {len(references)} distinct greedy requests on the healthy cluster in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    # One client for the warm-up and another for the run, each closed before the stack is
    # measured: its pooled connections would count as the gateway's descriptors.
    warm = await run_with_client(args, base_url, config, make_workload(args.warmup, args.seed + 1, pool=pool),
                                 references)
    warm_errors = Counter(o.error for o in warm if o.error)
    print(f"warm-up: {len(warm)} requests, unexpected errors {dict(warm_errors) or 'none'}", flush=True)
    before = await wait_idle(config, args.idle_timeout)
    specs = make_workload(args.requests, args.seed, pool=pool)
    print(f"mix: {dict(sorted(Counter(s.kind for s in specs).items()))}", flush=True)
    start = time.perf_counter()
    cuts: list[Partition] | None = None
    if stack is None:
        outcomes = await run_with_client(args, base_url, config, specs)
    else:
        rebuilds = await asyncio.to_thread(stack.metric, "scheduler", REBUILDS)
        stop = asyncio.Event()
        driver = asyncio.create_task(partitions(args, stack, start, stop))
        try:
            outcomes = await run_with_client(args, base_url, config, specs, references)
        finally:
            stop.set()
            cuts = await driver
        rebuilds = await asyncio.to_thread(stack.metric, "scheduler", REBUILDS) - rebuilds
    elapsed = time.perf_counter() - start
    after = await wait_idle(config, args.idle_timeout)
    result = judge(args, specs, outcomes, elapsed, before, after, warm_errors, cuts)
    if stack is not None:  # the partitions cut off work in flight: the scheduler rebuilt it
        result["rebuilds"] = int(rebuilds)
        result["kv_reclaimed"] = int(await asyncio.to_thread(stack.metric, "scheduler", RECLAIMED))
        result["pass"] = result["pass"] and rebuilds > 0
    return result


def judge(args, specs: list[Spec], outcomes: list[Outcome], elapsed: float, before: Snapshot,
          after: Snapshot, warm_errors: Counter, cuts: list[Partition] | None = None) -> dict:
    tol = args.tolerance
    # Under partitions (--hosts) a request may end with an error that names its cause.
    allowed = [o for o in outcomes if o.error and o.clear and cuts is not None]
    errors = Counter(o.error for o in outcomes if o.error and not (o.clear and cuts is not None))
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
    hosts: dict = {}
    if cuts is not None:
        serving = [c.serving_after_s for c in cuts]
        whole = [c.whole_after_s for c in cuts]
        rejoined = [c.rejoined_after_s for c in cuts if c.rejoined_after_s is not None]
        recovered = bool(cuts) and None not in serving and None not in whole
        ok = ok and recovered
        hosts = {"partitions": [dataclasses.asdict(c) for c in cuts], "recovered": recovered,
                 "serving_after_s": {"median": _round(pct([x for x in serving if x is not None], 0.5)),
                                     "worst": None if None in serving else max(serving, default=None)},
                 "whole_after_s": {"median": _round(pct([x for x in whole if x is not None], 0.5)),
                                   "worst": None if None in whole else max(whole, default=None)},
                 "rejoined_after_s": {"median": _round(pct(rejoined, 0.5)), "worst": max(rejoined, default=None),
                                      "n": len(rejoined)},
                 "clear_errors": dict(Counter(o.error for o in allowed)),
                 "exact": sum(1 for o in outcomes if not o.error and o.kind in ("chat_stream", "completion", "stop"))}
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
        **hosts,
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
    if "partitions" in result:
        cut = result["partitions"][0]["cut_s"] if result["partitions"] else "-"
        print(f"partitions: {len(result['partitions'])} (each {cut} s); "
              f"serving again after the heal: median {result['serving_after_s']['median']} s, worst "
              f"{result['serving_after_s']['worst']} s; every service back: median {result['whole_after_s']['median']} "
              f"s, worst {result['whole_after_s']['worst']} s; far side working again: median "
              f"{result['rejoined_after_s']['median']} s, worst {result['rejoined_after_s']['worst']} s (of "
              f"{result['rejoined_after_s']['n']} seen before the run ended)")
        print(f"the scheduler's rebuilds of cut-off work: {result['rebuilds']}; sequences attention workers freed "
              f"because no request held them (held back by a partition): {result['kv_reclaimed']}; "
              f"finished requests equal to their reference: {result['exact']}; ended with a clear error "
              f"(allowed under partitions): {sum(result['clear_errors'].values())} {result['clear_errors'] or ''}")
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


# --hosts: the cluster of tests/cluster (every service on a network namespace of its own).
APART = ("model-1", "attention-1")  # the half a partition cuts off
# KV that a partition held back until after its request's Free is freed this long after it
# arrived (deadlines.kv_reclaim_s; 60 s by default), so well within --idle-timeout.
KV_RECLAIM_S = 20.0


def hosts_stack():
    """Hosts (up) and the HostsStack (not started) of --hosts."""
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    sys.path[:0] = [str(repo / "tests" / "cluster"), str(repo / "tests" / "e2e")]
    from hosts_stack import DEADLINES, HostsStack, host_names, hosts_config
    from netns import Hosts, missing

    why = missing()
    if why is not None:
        raise SystemExit(f"--hosts: {why}")
    config = hosts_config(attention_workers=2, model_workers=2,
                          deadlines=dataclasses.replace(DEADLINES, kv_reclaim_s=KV_RECLAIM_S))
    config = dataclasses.replace(config, prefill=dataclasses.replace(
        config.prefill, cache_device_bytes=CACHE_BYTES, cache_host_bytes=CACHE_BYTES))
    hosts = Hosts(host_names(config), apart=APART).up()
    return hosts, HostsStack(config, hosts)


def run_inside(inside, make) -> dict:
    """`make()`'s coroutine run by `inside` (a thread on the gateway's host); Ctrl-C here
    cancels it there."""
    running: dict = {}

    async def main() -> dict:
        running["loop"], running["task"] = asyncio.get_running_loop(), asyncio.current_task()
        return await make()

    try:
        return inside(lambda: asyncio.run(main()))
    except KeyboardInterrupt:
        if running:
            running["loop"].call_soon_threadsafe(running["task"].cancel)
        raise


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
    ap.add_argument("--hosts", action="store_true",
                    help="every service on a host of its own (network namespaces; root), the cluster split in two "
                         "every --partition-every s; normal requests greedy and checked against references")
    ap.add_argument("--partition-every", type=float, default=30.0, help="--hosts: a partition every this many s")
    ap.add_argument("--partition-s", type=float, default=10.0, help="--hosts: each lasting this many s")
    ap.add_argument("--recovery-timeout", type=float, default=120.0,
                    help="--hosts: a partition not recovered from this long after its heal fails the run (s)")
    ap.add_argument("--pool", type=int, default=16, help="--hosts: distinct prompts of each kind (chat, completion)")
    args = ap.parse_args()
    if args.hosts and args.base_url:
        ap.error("--hosts starts its own cluster: leave --base-url out")
    if args.hosts and not 0 < args.partition_s < args.partition_every:
        ap.error("--partition-s must be positive and shorter than --partition-every")

    # SIGTERM stops the run as Ctrl-C does: the finally below stops every process started here.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    print(f"soak: {args.requests} requests (+{args.warmup} warm-up), concurrency {args.concurrency}, seed "
          f"{args.seed}, max_tokens {'8, 16 or 24' if args.hosts else '4..24'}, mix weights {KIND_WEIGHTS}, "
          f"client deadline {args.timeout:.0f} s")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}, {platform.python_implementation()} "
          f"{platform.python_version()}", flush=True)
    stack = hosts = result = None
    try:
        if args.hosts:
            hosts, stack = hosts_stack()
            print(f"starting the cluster on {len(hosts.names)} hosts ({', '.join(hosts.names)}; {', '.join(APART)} "
                  f"on the far side of each partition, {args.partition_s:g} s every {args.partition_every:g} s; "
                  f"prefix cache 16 + 16 MiB)...", flush=True)
            t0 = time.perf_counter()
            stack.start()
            print(f"cluster up in {time.perf_counter() - t0:.0f} s at {stack.base_url}; logs in {stack.log_dir}",
                  flush=True)
            base_url, config = stack.base_url, stack.config
            result = run_inside(stack.inside, lambda: soak(args, base_url, config, stack))
        elif args.base_url:
            base_url, config = args.base_url.rstrip("/"), find_config(args.base_url, args.config)
        else:
            from lamina.ports import free_port
            from lamina.services.config import GatewaySection, PrefillSection, StackConfig
            from lamina.services.launch.launcher import Stack

            # A small prefix cache, full after the warm-up: the default one (256 + 512 MiB)
            # would grow the prefill worker's RSS by design for the whole run.
            stack = Stack(StackConfig(gateway=GatewaySection(port=free_port()),
                                      prefill=PrefillSection(cache_device_bytes=CACHE_BYTES,
                                                             cache_host_bytes=CACHE_BYTES)))
            print("starting the stack (defaults: 2 attention workers, 1 model worker, tcp; prefix cache 16 + 16 "
                  "MiB)...", flush=True)
            t0 = time.perf_counter()
            stack.start()
            print(f"stack up in {time.perf_counter() - t0:.0f} s at {stack.base_url}; logs in {stack.log_dir}",
                  flush=True)
            base_url, config = stack.base_url, stack.config
        if not args.hosts:
            result = asyncio.run(soak(args, base_url, config))
    except KeyboardInterrupt as exc:
        print(f"interrupted ({exc or 'Ctrl-C'}); stopping what was started", flush=True)
        result = None
    finally:
        if stack is not None:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the stop short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            stack.keep_logs = result is None or not result["pass"]  # the services' logs, to see why
            if stack.keep_logs:
                print(f"the services' logs are kept in {stack.log_dir}", flush=True)
            stack.stop()
        if hosts is not None:
            hosts.down()
    if result is None:
        return 130
    report(result)
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
