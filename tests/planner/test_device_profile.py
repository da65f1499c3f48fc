"""`lamina profile --device D` (planner/measure/device_profile.py): a torch device measured
into a catalogue entry the planner reads. On a GPU it measures the GPU; here it runs on
the CPU's torch operators with a small random model, which checks what it writes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from lamina.planner.hardware import THIS_MACHINE, device_from_entry


def test_a_device_profile_is_an_accelerator_entry_the_planner_reads(tmp_path):
    out = tmp_path / "profile-cpu.json"
    run = subprocess.run([sys.executable, "-P", "-m", "lamina.cli", "profile", "--device", "cpu", "--dtype", "float32",
                          "--quick", "--model", "random:smollm2-135m", "--out", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert f"wrote {out}" in run.stdout and "GB/s" in run.stdout
    prof = json.loads(out.read_text())
    entry, measured = prof["device"], prof["measurements"]
    device = device_from_entry(THIS_MACHINE, entry)
    assert not device.is_cpu  # no cores: the planner's accelerator models
    assert device.linear_s_per_param and all(s > 0 for s in device.linear_s_per_param.values())
    assert device.attention_bw and device.attention_bw > 0 and device.memory_bw > 0
    assert entry["layer_overhead_us"]["value"] >= 0 and len(measured["engine_overhead"]["points"]) == 2
    assert measured["dtype"] == "float32" and prof["torch"] == torch.__version__


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA (this one has a CUDA device)")
def test_a_device_torch_cannot_use_is_refused_in_one_line(tmp_path):
    run = subprocess.run([sys.executable, "-P", "-m", "lamina.cli", "profile", "--device", "cuda:0", "--out",
                          str(tmp_path / "p.json")], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 2 and "torch finds no CUDA device here" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and not (tmp_path / "p.json").exists()


def test_a_device_name_torch_does_not_know_is_refused_in_one_line(tmp_path):
    run = subprocess.run([sys.executable, "-P", "-m", "lamina.cli", "profile", "--device", "gpu0", "--out",
                          str(tmp_path / "p.json")], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 2 and run.stderr.startswith("lamina profile: ") and "gpu0" in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and not (tmp_path / "p.json").exists()


def test_the_attention_rate_is_what_each_byte_more_costs_not_a_calls_fixed_cost():
    """An H200's three cases (random:llama-3.2-1b in bfloat16, one layer: 4.2 MB of KV in
    314 us, 33.6 MB in 349 us, 269 MB in 377 us): bytes over seconds said 96 GB/s (the
    median), which made every batch-64 engine point the planner predicted 4 to 7 times too
    slow; the line through them streams at the memory's rate, capped by it. One size, or a
    slope noise turned negative, falls back to the median."""
    from lamina.planner.measure.device_profile import marginal_bytes_s

    h200 = [(4196352, 314e-6), (33587200, 349e-6), (268566528, 377e-6)]
    assert marginal_bytes_s(h200, 10e12) == pytest.approx(5.18e12, rel=0.01)
    assert marginal_bytes_s(h200, 4.07e12) == 4.07e12
    assert marginal_bytes_s([(1e6, 1e-3), (1e6, 2e-3), (1e6, 3e-3)], 1e12) == pytest.approx(0.5e9)
    assert marginal_bytes_s([(1e6, 3e-3), (2e6, 1e-3)], 1e12) == pytest.approx(7e9 / 6)  # median of 1/3 and 2 GB/s
