"""Workloads: requests (arrival time, prompt and output lengths) from a trace file in the
formats of ../shared/traces (Azure CSV, Kimi/Mooncake JSONL) or from given lengths and a
rate, and the moments the analytical models need."""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path


@dataclass(frozen=True)
class Request:
    arrival_s: float  # from the first request's arrival
    prompt: int
    output: int


@dataclass(frozen=True)
class WorkloadStats:
    requests: int
    duration_s: float
    rate: float  # requests per second
    mean_prompt: float
    mean_prompt_sq: float  # E[p^2]: prefill's attention term is quadratic in the prompt
    mean_output: float

    @property
    def mean_context(self) -> float:
        """Mean tokens of KV a decoding request holds over its life: the prompt and half
        its output."""
        return self.mean_prompt + self.mean_output / 2

    @property
    def output_tok_s(self) -> float:
        """Output tokens per second the workload asks for."""
        return self.rate * self.mean_output


@dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple[Request, ...]

    def __post_init__(self) -> None:
        if not self.requests:
            raise ValueError(f"{self.name}: no requests")

    def stats(self) -> WorkloadStats:
        n = len(self.requests)
        duration = self.requests[-1].arrival_s - self.requests[0].arrival_s
        # One request (or all at once): call it one second so the rate stays finite.
        rate = (n - 1) / duration if duration > 0 else float(n)
        return WorkloadStats(
            requests=n, duration_s=duration, rate=rate,
            mean_prompt=sum(r.prompt for r in self.requests) / n,
            mean_prompt_sq=sum(r.prompt ** 2 for r in self.requests) / n,
            mean_output=sum(r.output for r in self.requests) / n,
        )

    def head(self, n: int) -> Workload:
        return Workload(f"{self.name} (first {n})", self.requests[:n])


AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")  # an Azure trace's, in its order


def _azure_time(text: str) -> float:
    # "2023-11-16 18:15:46.6805900": seven fractional digits, more than datetime parses.
    head, _, frac = text.strip().partition(".")
    return datetime.fromisoformat(head).timestamp() + (float("0." + frac) if frac else 0.0)


def load_trace(path: str | Path) -> Workload:
    """An Azure CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`) or a Kimi JSONL
    (`{"timestamp": ms, "input_length", "output_length", ...}`) trace, in arrival order."""
    path = Path(path)
    rows: list[tuple[float, int, int]] = []
    jsonl = path.suffix == ".jsonl"
    kind = ("a Kimi JSONL trace (timestamp, input_length, output_length)" if jsonl
            else "an Azure CSV trace (TIMESTAMP,ContextTokens,GeneratedTokens)")
    line = 0
    try:
        if jsonl:
            with path.open() as f:
                for n, text in enumerate(f, 1):
                    line = n  # named by the error, if this one raises
                    if text.strip():
                        r = json.loads(text)
                        rows.append((float(r["timestamp"]) / 1000, int(r["input_length"]), int(r["output_length"])))
        else:
            with path.open(newline="") as f:
                reader = csv.DictReader(f)
                for r in reader:
                    line = reader.line_num  # the row's last line (a quoted field may span several)
                    missing = [k for k in AZURE_COLUMNS if r.get(k) is None]
                    if missing:  # a column absent, or a row shorter than the header
                        raise KeyError(missing[0])
                    rows.append((_azure_time(r["TIMESTAMP"]), int(r["ContextTokens"]), int(r["GeneratedTokens"])))
    except (KeyError, ValueError, TypeError, csv.Error) as exc:  # OSError: the caller's to report
        what = f"no field {exc}" if isinstance(exc, KeyError) else str(exc)
        where = f"line {line}: " if line else ""
        raise ValueError(f"{path}: {where}not {kind}: {what}") from None
    if not rows:
        raise ValueError(f"{path}: no requests")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    # A request needs at least one prompt and one output token to be served.
    reqs = tuple(Request(t - t0, max(1, p), max(1, o)) for t, p, o in rows)
    return Workload(path.name, reqs)


def synthetic(prompt: int, output: int, rate: float, requests: int = 1000, seed: int = 0) -> Workload:
    """Fixed lengths, Poisson arrivals at `rate` per second (seeded)."""
    if prompt < 1 or output < 1 or rate <= 0 or requests < 1:
        raise ValueError("lengths, rate and requests must be positive")
    rng = random.Random(seed)
    t, reqs = 0.0, []
    for _ in range(requests):
        reqs.append(Request(t, prompt, output))
        t += rng.expovariate(rate)
    return Workload(f"synthetic p={prompt} o={output} rate={rate}/s", tuple(reqs))
