"""`lamina up --layout auto`: the layout this machine serves fastest, as the planner predicts.

`lamina up` can start two layouts on one host: colocated (each model worker attends in
its own process, on 1 up to the host's cores of compute threads, each thread count the
profile measured) and disaggregated (attention workers of their own, 1 or 2 here, with 1
or 2 staggered micro-batches), each with the weights in any of the precisions that keep
the checkpoint's values (`lossless_weights`: a GGUF file's own blocks or float32) unless
one is set. `rank_layouts` ranks them by the planner's predicted
decode tokens/s (lamina.planner.estimate.decode_step) for a serving workload on this
machine's profile, every service sharing the host's cores (`Layout.shared_host`): a
pure function of the profile, the model's shape and the workload. A workload is either
closed (so many requests decoding at once) or open (requests arriving at a rate: given,
or a trace's); for an open one each layout decodes as many at once as it needs to keep
up (`concurrency_at_rate`), and the layouts that keep up rank by their time per token. `machine_profile`
gives the profile: the one `lamina profile` wrote when it was measured on this machine
by this version of Lamina, else a new `lamina profile --quick`, written there.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from lamina.planner.estimate import decode_step
from lamina.planner.hardware import THIS_MACHINE, device_from_entry, load_catalogue
from lamina.planner.layouts import Layout
from lamina.planner.perf.quantization import FP32, INT4, PACKED_PRECISIONS, Q8_0, Precision
from lamina.planner.profile import memory_bytes
from lamina.planner.shapes import ModelShape
from lamina.planner.workload import load_trace

ATTENTION_WORKER_CHOICES = (1, 2)
MICRO_BATCH_CHOICES = (1, 2)
# An open workload's requests decoding at once are at most this many as parsed (the
# scheduler's largest default max_batch_size, a GPU's); lamina up caps it at the
# configured one: a layout that needs more to keep up falls behind.
RATE_MAX_CONCURRENCY = 256
WORKLOAD_FORMS = ("CONCURRENCY,PROMPT_TOKENS,OUTPUT_TOKENS (e.g. 8,512,256), PROMPT_TOKENS,OUTPUT_TOKENS@RATE "
                  "(requests per second, e.g. 512,256@2.5) or a trace file (Azure CSV or Kimi JSONL)")


@dataclass(frozen=True)
class LocalWorkload:
    """The serving load the layouts are ranked for: `concurrency` requests decoding at
    once, each of `prompt_tokens` and `output_tokens` (a few people chatting by default);
    or, with `rate`, requests arriving at `rate` a second, at most `concurrency` of them
    decoding at once (a trace's mean lengths and rate: `source` names it)."""

    concurrency: int = 8
    prompt_tokens: int = 512
    output_tokens: int = 256
    rate: float | None = None
    source: str = ""

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError("the workload's concurrency, prompt and output tokens must be positive")
        if self.rate is not None and not self.rate > 0:
            raise ValueError("the workload's rate must be positive")

    @property
    def mean_context(self) -> float:
        """Tokens a decoding request attends over, on average over its output."""
        return self.prompt_tokens + self.output_tokens / 2

    @classmethod
    def parse(cls, text: str) -> LocalWorkload:
        """"CONCURRENCY,PROMPT,OUTPUT" ("8,512,256"), "PROMPT,OUTPUT@RATE" ("512,256@2.5"),
        or the path of a trace (its mean prompt and output lengths and its arrival rate)."""
        if Path(text).is_file():
            try:
                stats = load_trace(text).stats()
            except ValueError as exc:  # names the file, the line and what it lacks
                raise ValueError(f"--workload {exc}") from None
            except OSError as exc:
                raise ValueError(f"--workload {text}: {exc.strerror or exc}") from None
            return cls(RATE_MAX_CONCURRENCY, max(1, round(stats.mean_prompt)), max(1, round(stats.mean_output)),
                       stats.rate, Path(text).name)
        lengths, at, rate = text.partition("@")
        parts = lengths.split(",")
        try:
            if at:
                if len(parts) != 2:
                    raise ValueError
                return cls(RATE_MAX_CONCURRENCY, int(parts[0]), int(parts[1]), float(rate))
            if len(parts) != 3:
                raise ValueError
            concurrency, prompt, output = (int(p) for p in parts)
            return cls(concurrency, prompt, output)
        except ValueError:
            raise ValueError(f"--workload takes {WORKLOAD_FORMS}, with positive numbers; got {text!r}") from None

    def describe(self) -> str:
        if self.rate is not None:
            return (f"{self.rate:.3g} requests/s of {self.prompt_tokens}-token prompts and {self.output_tokens} "
                    f"output tokens" + (f" (the means of {self.source})" if self.source else ""))
        return (f"{self.concurrency} request{'s' * (self.concurrency > 1)} at once, {self.prompt_tokens}-token "
                f"prompts, {self.output_tokens} output tokens")


@dataclass(frozen=True)
class LocalChoice:
    """One layout `lamina up` can start here, with its predicted decode tokens/s."""

    layout: str  # "colocated" or "disaggregated"
    attention_workers: int  # 0 colocated
    micro_batches: int
    tok_s: float
    bottleneck: str
    batch: int = 0  # requests decoding at once
    step_s: float = 0.0  # time per token of each
    keeps_up: bool | None = None  # an open workload's rate: whether it is served (None: a closed one)
    threads: int = 1  # the model worker's compute threads (ranked for colocated; 1 disaggregated)
    weights: str = ""  # the `model.weights` choice, where it was ranked ("": the configured one)
    device: str = ""  # the GPU every service computes on ("": the host's cores)

    def predicted(self) -> str:
        """What the planner predicts of it, in words."""
        if self.keeps_up is None:
            return f"{self.tok_s:.0f} tok/s"
        if self.keeps_up:
            return f"{self.step_s * 1e3:.0f} ms/token with {self.batch} decoding"
        return f"falls behind ({self.tok_s:.0f} tok/s with {self.batch} decoding)"

    def describe(self) -> str:
        weights = f", weights {self.weights}" if self.weights else ""
        if self.device:
            if self.layout == "colocated":
                return f"colocated on {self.device}{weights}"
            weights = f" on {self.device}{weights}"
        elif self.layout == "colocated":
            return f"colocated, {self.threads} thread{'s' * (self.threads > 1)}{weights}"
        return (f"disaggregated, {self.attention_workers} attention worker{'s' * (self.attention_workers > 1)}, "
                f"{self.micro_batches} micro-batch{'es' * (self.micro_batches > 1)}{weights}")

    def overrides(self) -> dict[str, Any]:
        """The stack configuration keys that start this layout."""
        weights = {"weights": self.weights} if self.weights else {}
        if self.layout == "colocated":
            return {"layout": "colocated", **weights}
        return {"layout": "disaggregated", "attention.workers": self.attention_workers,
                "pipeline.micro_batches": self.micro_batches, **weights}


# The most threads `lamina up --layout auto` ranks for a colocated model worker's products
# (and `lamina profile` measures): a decode step's products split at most a handful of
# ways at small batches (the kernel's minimum work per thread), so more would only spin.
MAX_AUTO_MODEL_THREADS = 8


def thread_choices(host_cores: int) -> tuple[int, ...]:
    """The compute-thread counts measured and ranked on a host of `host_cores`: 1, the
    powers of two below the cores, and the cores themselves (at most MAX_AUTO_MODEL_THREADS)."""
    top = max(1, min(MAX_AUTO_MODEL_THREADS, host_cores))
    return tuple(sorted({1, top, *(t for t in (2, 4) if t < top)}))


def auto_model_threads(choice: LocalChoice, cores: int, model_workers: int) -> int | None:
    """The compute threads `lamina up --layout auto` gives each model worker when nothing
    sets them: colocated, the thread count the planner ranked first (`choice.threads`),
    within the host's `cores` shared among the model workers; None (the configured default,
    one) for a disaggregated layout, whose attention workers need cores of their own, and
    on a GPU (`choice.device`: torch's products there, not the packed kernels' threads)."""
    if choice.layout != "colocated" or choice.device:
        return None
    return max(1, min(choice.threads, cores // max(1, model_workers)))


def weights_precision(weights: str, file_formats: Mapping[str, int]) -> Precision:
    """The planner's precision for `model.weights`: q4 is its min-max 4-bit (the engine's
    Q4_1 blocks), q8_0 Q8_0's blocks, float32 float32; as_file the packed format most of
    the checkpoint's matrices are in (`file_formats`, lamina.model.checkpoints.
    file_weight_formats: none for a float checkpoint, whose as_file weights are float32)."""
    if weights == "as_file":
        packed = sorted((n, fmt) for fmt, n in file_formats.items() if fmt in PACKED_PRECISIONS)
        return PACKED_PRECISIONS[packed[-1][1]] if packed else FP32
    return {"q4": INT4, "q8_0": Q8_0}.get(weights, FP32)


def lossless_weights(file_formats: Mapping[str, int]) -> tuple[str, ...]:
    """The `model.weights` choices `lamina up --layout auto` ranks when none is set: those
    that compute with the checkpoint's own values. A checkpoint in packed blocks has two,
    its blocks as they are (as_file) and the same values as float32, and which is faster
    depends on the machine and the batch (the products' measured cost per weight in each
    format); any other has one (as_file, float32 there). q8_0 and q4 round the weights again,
    so they are the user's to ask for."""
    return ("as_file", "float32") if any(fmt in PACKED_PRECISIONS for fmt in file_formats) else ("as_file",)


def rank_layouts(device_entry: Mapping[str, Any], shape: ModelShape, weights: Mapping[str, Precision],
                 workload: LocalWorkload) -> list[LocalChoice]:
    """Every layout `lamina up` can start here with each of `weights` (a `model.weights`
    choice -> its precision), fastest first, for `workload` on the machine `device_entry`
    describes (a profile's "device")."""
    catalogue = dict(load_catalogue())
    device = catalogue[THIS_MACHINE] = device_from_entry(THIS_MACHINE, device_entry)
    host_cores = device.host_cores or 1
    candidates = []
    for choice, precision in weights.items():
        label = choice if len(weights) > 1 else ""  # printed only where it was ranked
        candidates += [("colocated", 0, 1, label, host_layout(0, 1, precision, threads))
                       for threads in device.measured_threads if threads <= host_cores]
        for workers in ATTENTION_WORKER_CHOICES:
            for micro in MICRO_BATCH_CHOICES:
                candidates.append(("disaggregated", workers, micro, label, host_layout(workers, micro, precision)))
    return rank_candidates(candidates, shape, catalogue, workload)


def rank_candidates(candidates: list[tuple[str, int, int, str, Layout]], shape: ModelShape,
                    catalogue: Mapping[str, Any], workload: LocalWorkload, device: str = "") -> list[LocalChoice]:
    """(layout name, attention workers, micro-batches, weights label, Layout) candidates as
    LocalChoices predicted on `catalogue`, fastest first (`device`: the GPU they run on)."""
    ranked = []
    for name, workers, micro, label, layout in candidates:
        def step_s(c: int, layout: Layout = layout) -> float:
            return decode_step(shape, layout, catalogue, c, workload.mean_context).step_s

        keeps_up = None
        batch = workload.concurrency
        if workload.rate is not None:
            batch, keeps_up = concurrency_at_rate(step_s, workload.rate, workload.output_tokens, workload.concurrency)
        step = decode_step(shape, layout, catalogue, batch, workload.mean_context)
        ranked.append(LocalChoice(name, workers, micro, batch / step.step_s, step.bottleneck, batch, step.step_s,
                                  keeps_up, layout.threads, label, device))
    if workload.rate is None:
        return sorted(ranked, key=lambda c: -c.tok_s)
    # Those that keep up serve the same tokens/s: the shortest time per token first; then
    # those that fall behind, the most tokens/s first.
    return sorted(ranked, key=lambda c: (not c.keeps_up, c.step_s if c.keeps_up else -c.tok_s))


def host_layout(attention_workers: int, micro_batches: int, weights: Precision, threads: int = 1) -> Layout:
    """A layout `lamina up` starts on this host, every service sharing its cores:
    colocated (`attention_workers` 0; its model worker on `threads` compute threads) or
    disaggregated (request partitioning), float32 KV."""
    if attention_workers == 0:
        return Layout(THIS_MACHINE, 1, weights=weights, kv=FP32, shared_host=True, threads=threads)
    return Layout(THIS_MACHINE, 1, 1, THIS_MACHINE, attention_workers, micro_batches, "request", weights, FP32,
                  shared_host=True)


def concurrency_at_rate(step_s: Callable[[int], float], rate: float, output_tokens: int,
                        cap: int) -> tuple[int, bool]:
    """How many requests decode at once when `rate` arrive a second, each for
    `output_tokens` steps of `step_s(c)` seconds with c decoding: by Little's law the
    least c with rate x output_tokens x step_s(c) <= c (the layout's c / step_s(c) tokens/s
    at least the rate's). (cap, False) when none up to `cap` keeps up."""
    for c in range(1, cap + 1):
        if rate * output_tokens * step_s(c) <= c:
            return c, True
    return cap, False


def _cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo's on Linux, where profiles are measured)."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


# What a profile holds, in its fingerprint: a profile of an earlier format is measured
# again (2: the compute threads' speedup, `thread_speedup`; 3: the products and that
# speedup each the fastest of their rounds; 4: the speedup measured until it settles; 5:
# every kernel time and the engine's overhead steps the fastest of their repeats).
PROFILE_FORMAT = 5


def machine_fingerprint() -> str:
    """What a profile holds for: this CPU, its cores, its memory, this Lamina's version and the
    profile's format."""
    try:
        version = metadata.version("lamina")
    except metadata.PackageNotFoundError:
        version = "unknown"
    text = json.dumps([_cpu_model(), os.cpu_count(), int(memory_bytes()) >> 30, platform.system(), version,
                       PROFILE_FORMAT])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# Other processes taking more than this many cores (on average) while the profile was
# measured make it suspect: its figures are partly the neighbours'.
BUSY_FOREIGN_CORES = 0.5
# How many measurements in a row may be suspect before the last one is kept anyway (a
# host that is always busy must not pay the measurement at every start).
BUSY_MEASUREMENTS = 2


def foreign_cores(profile: Mapping[str, Any]) -> float:
    """The cores other processes took while `profile` was measured (0 where not recorded)."""
    measurements = profile.get("measurements")
    value = measurements.get("foreign_cores") if isinstance(measurements, Mapping) else None
    return float(value) if isinstance(value, (int, float)) else 0.0


def unsettled_speedups(profile: Mapping[str, Any]) -> list[str]:
    """The thread counts whose speedup did not settle in its rounds (planner/profile.py's
    speedup_settled: a neighbour on a core for all of them, or threads that barely pay)."""
    measurements = profile.get("measurements")
    table = measurements.get("thread_speedup") if isinstance(measurements, Mapping) else None
    if not isinstance(table, Mapping):
        return []
    return [t for t, v in table.items() if isinstance(v, Mapping) and v.get("settled") is False]


def suspect(profile: Mapping[str, Any]) -> str | None:
    """Why `profile`'s figures are suspect, or None: other processes were busy while it was
    measured, or the compute threads' speedup did not settle."""
    busy = foreign_cores(profile)
    if busy > BUSY_FOREIGN_CORES:
        return f"other processes took {busy:.1f} cores while this machine was measured"
    unsettled = unsettled_speedups(profile)
    if unsettled:
        return (f"the speedup on {', '.join(unsettled)} compute threads did not settle while this machine was "
                "measured (a neighbour on a core?)")
    return None


def remeasure_busy(profile: Mapping[str, Any]) -> bool:
    """Whether a profile whose figures are suspect (`suspect`) is measured again: yes until
    BUSY_MEASUREMENTS in a row were (`busy_measurements` counts them)."""
    return suspect(profile) is not None and int(profile.get("busy_measurements", 1)) < BUSY_MEASUREMENTS


def machine_profile(path: Path, measure: Callable[[], dict[str, Any]], say: Callable[[str], None]) -> dict[str, Any]:
    """The profile at `path` when it was measured on this machine by this version (its
    "fingerprint") and not while other processes were busy (`remeasure_busy`), else
    `measure()`'s, written to `path` with the fingerprint."""
    fingerprint = machine_fingerprint()
    busy_before = 0
    try:
        held = json.loads(path.read_text())
        if not (isinstance(held, dict) and held.get("fingerprint") == fingerprint and "device" in held):
            why = "measured on another machine or by another version"
        elif remeasure_busy(held):
            why = f"suspect: {suspect(held)}"
            busy_before = int(held.get("busy_measurements", 1))
        else:
            return held
    except FileNotFoundError:
        why = "none yet"
    except (OSError, ValueError):
        why = "unreadable"
    say(f"measuring this machine for the layout choice ({why} in {path}; lamina profile --quick, "
        f"about a minute, once)...")
    result = dict(measure())
    result["fingerprint"] = fingerprint
    why_suspect = suspect(result)
    if why_suspect is not None:
        result["busy_measurements"] = busy_before + 1
        again = ("the next start measures again" if remeasure_busy(result)
                 else f"kept: {result['busy_measurements']} measurements in a row were")
        say(f"{why_suspect}: the figures, and the layout chosen from them, may be off ({again}; "
            "`lamina profile` re-measures when the machine is quiet)")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return result
