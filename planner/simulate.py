"""A discrete-event simulator that replays a workload through `replicas` copies of a
layout, with the same performance models as the estimate.

What it models: arrivals from the trace; join-shortest-queue dispatch to units; in each
unit, continuous batching at step boundaries (FCFS admission while the KV of the running
requests and the new prompt fits and the batch is below `max_batch`); prefill of the
admitted prompts on the model workers before the step's decode (so a step that admits
is longer, as in a real continuous-batching server); the decode step's time from the
pipeline model (N micro-batches, M model workers, transfers) at the step's batch and mean
context; KV growing one token per request per step, with the newest request preempted
and recomputed (vLLM's policy) when it would overflow.

What it does not: one unit's model and attention workers are one server whose step time
is the pipeline model's, not separate processes; attention workers share the unit's KV
capacity evenly. So its cost grows with units and steps, not workers: tens to hundreds
of workers in a few units simulate in about a second.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace

from lamina.planner.estimate import decode_step, kv_capacity_tokens
from lamina.planner.hardware import Device
from lamina.planner.layouts import Layout
from lamina.planner.perf.prefill import prefill_time
from lamina.planner.shapes import ModelShape
from lamina.planner.workload import Request, Workload


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p90: float
    p99: float
    mean: float

    def as_ms(self) -> dict[str, float]:
        return {k: round(v * 1e3, 2) for k, v in (("p50", self.p50), ("p90", self.p90),
                                                    ("p99", self.p99), ("mean", self.mean))}


def weighted_percentiles(values: list[float], weights: list[float]) -> Percentiles:
    if not values:
        return Percentiles(math.nan, math.nan, math.nan, math.nan)
    pairs = sorted(zip(values, weights))
    total = sum(weights)
    if total <= 0:
        return Percentiles(math.nan, math.nan, math.nan, math.nan)
    marks, out, acc = [0.5, 0.9, 0.99], [], 0.0
    for v, w in pairs:
        acc += w
        while marks and acc >= marks[0] * total:
            out.append(v)
            marks.pop(0)
    out += [pairs[-1][0]] * len(marks)
    return Percentiles(out[0], out[1], out[2], sum(v * w for v, w in pairs) / total)


@dataclass(frozen=True)
class SimResult:
    completed: int
    output_tokens: int
    duration_s: float  # first arrival to last completion
    throughput_tok_s: float
    ttft: Percentiles
    tbt: Percentiles  # step durations weighted by the requests in each step
    mean_batch: float
    preemptions: int
    admissions: int = 0  # prefills, first ones and recomputations after preemption
    decode_tokens: int = 0  # tokens made by decode steps (each prefill makes one more)

    def to_dict(self) -> dict:
        return {"completed": self.completed, "output_tokens": self.output_tokens,
                "duration_s": round(self.duration_s, 2), "throughput_tok_s": round(self.throughput_tok_s, 1),
                "ttft_ms": self.ttft.as_ms(), "tbt_ms": self.tbt.as_ms(),
                "mean_batch": round(self.mean_batch, 1), "preemptions": self.preemptions}


@dataclass
class _Running:
    req: Request
    prompt: int  # tokens whose KV this request holds at admission (grows on recompute)
    admitted_step: int
    finish_step: int
    generated_before: int  # output tokens produced before this admission


@dataclass
class _Tally:
    """What a run counts as it goes."""

    done: int = 0
    tokens: int = 0
    preempted: int = 0
    admitted: int = 0
    last: float = 0.0  # the time of the last completion


class _Unit:
    """One replica: the waiting queue, the running batch and its KV accounting."""

    def __init__(self, capacity: int, max_batch: int) -> None:
        self.capacity = capacity
        self.max_batch = max_batch
        self.waiting: deque[tuple[Request, int]] = deque()  # (request, output tokens already made)
        self.running: dict[int, _Running] = {}  # insertion order = admission order
        self.finishing: list[tuple[int, int]] = []  # heap of (finish_step, id)
        self.step = 0
        self.kv_base = 0  # sum over running of (prompt + 1 - admitted_step)
        self.busy = False

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    def kv_used(self) -> int:
        return self.kv_base + len(self.running) * self.step


class Simulator:
    def __init__(self, shape: ModelShape, layout: Layout, catalogue: Mapping[str, Device], replicas: int,
                 max_batch: int) -> None:
        self.shape, self.layout, self.catalogue = shape, layout, catalogue
        capacity = kv_capacity_tokens(shape, layout, catalogue)
        self.units = [_Unit(capacity, max_batch) for _ in range(replicas)]
        self._ids = itertools.count()  # one per admission: a recomputed request is a new entry
        self._step_cache: dict[tuple[int, int], float] = {}
        self._prefill_cache: dict[int, float] = {}

    def step_s(self, batch: int, context: float) -> float:
        key = (batch, int(context) // 16)  # contexts within 16 tokens share a step time
        if key not in self._step_cache:
            layout = replace(self.layout, micro_batches=min(self.layout.micro_batches, batch))
            self._step_cache[key] = decode_step(self.shape, layout, self.catalogue, batch, context).step_s
        return self._step_cache[key]

    def prefill_s(self, prompt: int) -> float:
        if prompt not in self._prefill_cache:
            md = self.catalogue[self.layout.model_device]
            self._prefill_cache[prompt] = prefill_time(self.shape, md, prompt, self.layout.tp, self.layout.weights)
        return self._prefill_cache[prompt]

    def run(self, workload: Workload) -> SimResult:
        events: list[tuple[float, int, int, int]] = []  # (time, seq, kind, index)
        arrive, step_end = 0, 1
        for i, r in enumerate(workload.requests):
            events.append((r.arrival_s, i, arrive, i))
        heapq.heapify(events)
        seq = len(events)
        ttfts: list[float] = []
        step_times: list[float] = []
        step_batches: list[float] = []
        stats = _Tally()
        while events:
            now, _, kind, idx = heapq.heappop(events)
            if kind == arrive:
                unit_id = min(range(len(self.units)), key=lambda u: self.units[u].load)
                unit = self.units[unit_id]
                unit.waiting.append((workload.requests[idx], 0))
                if unit.busy:
                    continue
            else:
                unit_id, unit = idx, self.units[idx]
                unit.step += 1
                self._finish(unit, now, stats)
            duration = self._start_step(unit, now, ttfts, stats)
            unit.busy = duration > 0
            if unit.busy:
                if unit.running:  # a step of prefill alone makes no token between tokens
                    step_times.append(duration)
                    step_batches.append(len(unit.running))
                seq += 1
                heapq.heappush(events, (now + duration, seq, step_end, unit_id))
        first = workload.requests[0].arrival_s
        span = max(stats.last - first, 1e-9)
        return SimResult(stats.done, stats.tokens, span, stats.tokens / span,
                         weighted_percentiles(ttfts, [1.0] * len(ttfts)),
                         weighted_percentiles(step_times, step_batches),
                         sum(step_batches) / max(1, len(step_batches)), stats.preempted,
                         stats.admitted, int(sum(step_batches)))

    def _finish(self, unit: _Unit, now: float, stats: _Tally) -> None:
        while unit.finishing and unit.finishing[0][0] <= unit.step:
            _, rid = heapq.heappop(unit.finishing)
            run = unit.running.pop(rid, None)
            if run is None:  # preempted earlier; its heap entry is stale
                continue
            unit.kv_base -= run.prompt + 1 - run.admitted_step
            self._complete(run.req, now, stats)

    @staticmethod
    def _complete(req: Request, now: float, stats: _Tally) -> None:
        stats.done += 1
        stats.tokens += req.output
        stats.last = now

    def _start_step(self, unit: _Unit, now: float, ttfts: list[float], stats: _Tally) -> float:
        # Every running request adds one token of KV in the coming step: preempt the newest
        # until that fits (it is recomputed from its prompt and the tokens it has made).
        while unit.running and unit.kv_used() + len(unit.running) > unit.capacity:
            rid, run = unit.running.popitem()
            unit.kv_base -= run.prompt + 1 - run.admitted_step
            made = run.generated_before + 1 + (unit.step - run.admitted_step)
            unit.waiting.appendleft((run.req, made))
            stats.preempted += 1
        prefill = 0.0
        while unit.waiting and len(unit.running) < unit.max_batch:
            req, made = unit.waiting[0]
            prompt = req.prompt + made
            if unit.kv_used() + len(unit.running) + prompt + 2 > unit.capacity:
                break
            unit.waiting.popleft()
            prefill += self.prefill_s(prompt)
            stats.admitted += 1
            if made == 0:
                ttfts.append(now + prefill / self.layout.model_workers - req.arrival_s)
            remaining = req.output - made - 1  # the prefill makes one token
            if remaining <= 0:  # that token was the last: no decode step for it
                self._complete(req, now + prefill / self.layout.model_workers, stats)
                continue
            rid = next(self._ids)
            run = _Running(req, prompt, unit.step, unit.step + remaining, made)
            unit.running[rid] = run
            unit.kv_base += prompt + 1 - unit.step
            heapq.heappush(unit.finishing, (run.finish_step, rid))
        if not unit.running:
            return prefill / self.layout.model_workers  # prefill alone (0 when idle)
        context = unit.kv_used() / len(unit.running)
        return prefill / self.layout.model_workers + self.step_s(len(unit.running), context)


def simulated_shortfalls(result: SimResult, tbt_s: float | None, ttft_s: float | None) -> tuple[str, ...]:
    """The targets the simulation misses at its 90th percentiles (the estimate's TBT is a
    full-load step and its TTFT a mean, so the tail is what the simulation adds)."""
    misses = []
    if tbt_s is not None and result.tbt.p90 > tbt_s:
        misses.append("tbt")
    if ttft_s is not None and result.ttft.p90 > ttft_s:
        misses.append("ttft")
    return tuple(misses)


def simulate(shape: ModelShape, layout: Layout, catalogue: Mapping[str, Device], workload: Workload,
             replicas: int, max_batch: int) -> SimResult:
    return Simulator(shape, layout, catalogue, replicas, max_batch).run(workload)
