"""bench/gpu_handoff.py: without a CUDA device it stops at once and says so; on a GPU every
contender runs in processes of its own and reports its time a round trip, or its error,
and each kernel ran in turn (the shared value came out right); the probes of a killed
exporter report what the driver did."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton_helpers import NO_CUDA

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_handoff.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA (this one has a CUDA device)")
def test_without_a_gpu_it_stops_and_names_what_is_missing():
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "gpu_handoff needs a CUDA device" in run.stderr and torch.__version__ in run.stderr


@NO_CUDA
def test_on_a_gpu_each_handoff_is_timed_and_ordered():
    run = subprocess.run([sys.executable, str(SCRIPT), "--iters", "50", "--timeout", "60"], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    host = ("one_process_host", "one_process_device", "two_processes_host", "two_processes_event",
            "two_processes_cuda_ipc", "two_processes_cuda_ipc_device")
    assert set(host) <= got["us_per_round_trip"].keys(), got["errors"]
    assert all(got["correct"][name] for name in host) and all(got["us_per_round_trip"][n] > 0 for n in host)
    # The driver's stream memory operations may be missing: then the error says which call failed.
    if "two_processes_device" in got["errors"]:
        assert "cuStream" in got["errors"]["two_processes_device"] or "within" in got["errors"]["two_processes_device"]
    else:
        assert got["correct"]["two_processes_device"]
    assert got["exporter_exit"].get("read_before") == 7
    # The killed recorder's event was still pending when this process's stream began to wait.
    assert got["event_exit"].get("pending_before_kill") is True, got["event_exit"]
    assert "released_after_kill_s" in got["event_exit"] and "other_stream_runs" in got["event_exit"]
