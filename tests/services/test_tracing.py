"""services/tracing.py: a torch.profiler trace of a service on a signal. Here in one
process, by its calls and by its signals; through a real stack's model and attention
workers in tests/bench/test_gpu_decode.py."""

from __future__ import annotations

import asyncio
import gzip
import json
import os

import torch

from lamina.services import tracing


def _written(out, name: str) -> tuple[dict, str]:
    (chrome,) = out.glob(f"{name}-pid{os.getpid()}-*.json.gz")
    (table,) = out.glob(f"{name}-pid{os.getpid()}-*.txt")
    return json.loads(gzip.decompress(chrome.read_bytes())), table.read_text()


def test_a_trace_holds_the_operators_run_between_start_and_stop(tmp_path, monkeypatch):
    monkeypatch.setenv(tracing.TRACE_DIR_ENV, str(tmp_path))
    tracer = tracing.Tracer("model-3")
    assert tracer.stop() == []  # nothing recording: nothing written
    tracer.start()
    torch.matmul(torch.ones(64, 64), torch.ones(64, 64)).sum()
    files = tracer.stop()
    assert sorted(p.name for p in files) == [f"model-3-pid{os.getpid()}-0.json.gz", f"model-3-pid{os.getpid()}-0.txt"]
    chrome, table = _written(tmp_path, "model-3")
    names = {e.get("name") for e in chrome["traceEvents"]}
    assert {"aten::matmul", "aten::sum"} <= names
    assert table.startswith(f"model-3 (pid {os.getpid()}): operators by self CPU time") and "aten::mm" in table


async def test_the_signals_start_and_stop_a_trace_and_a_second_goes_to_its_own_files(tmp_path, monkeypatch):
    monkeypatch.setenv(tracing.TRACE_DIR_ENV, str(tmp_path))
    loop = asyncio.get_running_loop()
    tracing.install(loop, "attention-1")
    try:
        for n in range(2):
            os.kill(os.getpid(), tracing.TRACE_START)
            await asyncio.sleep(0.05)  # the loop runs the handler at its next turn
            torch.ones(8).add_(1)
            os.kill(os.getpid(), tracing.TRACE_STOP)
            await asyncio.sleep(0.05)
            assert (tmp_path / f"attention-1-pid{os.getpid()}-{n}.txt").is_file()
    finally:
        loop.remove_signal_handler(tracing.TRACE_START)
        loop.remove_signal_handler(tracing.TRACE_STOP)
