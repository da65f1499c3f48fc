"""A small synthetic profile for planner tests (imported by name: pyproject.toml puts this
directory on the tests' path)."""

from __future__ import annotations

from typing import Any


def figure(value: Any, source: str = "synthetic profile") -> dict[str, Any]:
    return {"value": value, "source": source}


def synthetic_entry(measured_quant: bool, q4_linear: float = 2e-10, q4_attention_ns: float = 0.2) -> dict[str, Any]:
    """A small synthetic profile: float32 kernel 4e-10 s per weight at batch 1, KV at 5 GB/s."""
    entry = {
        "memory_gb": figure(8.0), "memory_tb_s": figure(0.01), "scaleup_gb_s": figure(5.0),
        "network_gbit_s": figure(10.0), "network_latency_us": figure(30.0), "scaleup_latency_us": figure(1.0),
        "compute_efficiency": figure(1.0), "memory_efficiency": figure(1.0),
        "usd_per_hour": {"value": 0.1, "source": "assumed", "assumption": True}, "cores": figure(1),
        "tflops": {"bf16": figure(0.05), "fp32": figure(0.05)},
        "linear_s_per_param": figure({"1": 4e-10, "64": 4e-11}),
        "attention_tb_s": figure(0.005),
    }
    if measured_quant:
        entry["packed_linear_s_per_param"] = figure({"q4_1": {"1": q4_linear, "64": q4_linear / 10},
                                                     "q8_0": {"1": 3e-10, "64": 3e-11}})
        entry["attention_q4_ns_per_element"] = figure(q4_attention_ns)
        entry["kv_q4_quantize_ns_per_element"] = figure(1.0)
    return entry
