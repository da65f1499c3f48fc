"""aiperf (NVIDIA's load generator, `aiperf profile`) on bench/load_generator.py's workload.

The workload as guidellm gets it: N completions (`/v1/completions`, streamed) of P prompt
tokens and exactly T output tokens, C in flight. The endpoint is `completions`, not
`chat`: the server applies no chat template to its prompts, so the P tokens aiperf
synthesizes (counted with the served checkpoint's own tokenizer, the Hugging Face
directory Lamina converted the GGUF into) are the server's `usage.prompt_tokens`; and it
takes its token counts from the server's usage anyway (`--use-server-token-count`, which
asks for `stream_options.include_usage`). T is forced with `ignore_eos` and `max_tokens`
(`--use-legacy-max-tokens`: the completions API has no `max_completion_tokens`); greedy
(`temperature` 0) as bench/serving.py's client. No model hub (`aiperf_env` says how), no
dashboard, no server-metrics scraping or GPU telemetry; `workers` worker processes.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from load_clients import Figures, Workload, find_executable

TESTED_AIPERF = "0.13.0"  # the version whose command line and export format this script reads
EXPORT_NAME = "profile_export_aiperf.json"  # the summary aiperf writes in its artifact directory

_SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0}


def find_aiperf(explicit: str | None) -> Path | None:
    """--aiperf, else $AIPERF, else `aiperf` on PATH; None when none is there."""
    return find_executable("aiperf", explicit, "AIPERF")


def aiperf_version(binary: Path) -> str:
    """The version `aiperf --version` prints ("0.13.0")."""
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=300).stdout.split()
    return out[-1] if out else "unknown"


def aiperf_argv(binary: Path, url: str, model: str, tokenizer_dir: Path, w: Workload, artifacts: Path,
                workers: int) -> list[str]:
    """`aiperf profile` on the workload (the module docstring says why each choice)."""
    return [str(binary), "profile",
            "--model", model, "--url", url, "--endpoint-type", "completions", "--streaming",
            "--tokenizer", str(tokenizer_dir), "--use-server-token-count", "--use-legacy-max-tokens",
            "--isl", str(w.prompt_tokens), "--isl-stddev", "0", "--osl", str(w.output_tokens), "--osl-stddev", "0",
            "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
            "--num-dataset-entries", str(w.requests),  # a prompt of its own for every request
            "--concurrency", str(w.concurrency), "--request-count", str(w.requests), "--random-seed", "0",
            "--workers-max", str(workers), "--record-processors", "1",
            "--artifact-dir", str(artifacts), "--export-level", "summary",
            "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry"]


def aiperf_env() -> dict[str, str]:
    """No model hub: its address is a closed local port, so whatever would reach it fails
    at once. Not HF_HUB_OFFLINE=1 (nor TRANSFORMERS_OFFLINE, any value): with either set,
    aiperf 0.13 looks a --tokenizer that is a directory up in the hub's cache as a
    repository id (snapshot_download) and fails, where without it the directory is read
    as it is (aiperf.common.tokenizer: resolve_alias takes a path as local)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    return {**env, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_DATASETS_OFFLINE": "1"}


def parse_aiperf_export(doc: dict) -> Figures:
    """aiperf's JSON summary (profile_export_aiperf.json, schema 1.x, aiperf 0.13) -> Figures.

    Each metric is {"unit", "avg", "p50", "p99", ...} in its display unit (latencies in
    ms, the duration in s), converted here. Throughputs are over the benchmark's duration
    (first request sent to last response). TTFT is per request, from sending it to its
    first content chunk; inter-token latency is per request (latency - TTFT) / (output
    tokens - 1), so its percentiles are of per-request means (as guidellm's), and its
    average, every request having T tokens, is all gaps / their number."""
    schema = str(doc.get("schema_version", ""))
    if not schema.startswith("1."):
        raise ValueError(f"aiperf export schema version {schema!r}, expected 1.x")
    if doc.get("was_cancelled"):
        raise ValueError("the aiperf run was cancelled: its figures are partial")

    def metric(tag: str) -> dict:
        if not isinstance(doc.get(tag), dict):
            raise ValueError(f"the aiperf export has no {tag!r}")
        return doc[tag]

    def seconds(tag: str, stat: str) -> float:
        m = metric(tag)
        if m.get("unit") not in _SECONDS:
            raise ValueError(f"aiperf's {tag} in unit {m.get('unit')!r}")
        return float(m[stat]) * _SECONDS[m["unit"]]

    def value(tag: str, default: float | None = None) -> float:
        if default is not None and tag not in doc:
            return default
        return float(metric(tag)["avg"])

    requests = int(value("request_count"))
    return Figures(
        output_tok_s=value("output_token_throughput"), requests_s=value("request_throughput"),
        ttft_p50=seconds("time_to_first_token", "p50"), ttft_p99=seconds("time_to_first_token", "p99"),
        itl_p50=seconds("inter_token_latency", "p50"), itl_p99=seconds("inter_token_latency", "p99"),
        itl_mean=seconds("inter_token_latency", "avg"),
        requests=requests, errored=int(value("error_request_count", 0.0)),
        output_tokens=int(value("total_output_tokens")), seconds=seconds("benchmark_duration", "avg"))
