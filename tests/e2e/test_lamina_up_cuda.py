"""`lamina up --device cuda` as a user starts it, with every default for a GPU: the layout
auto chooses there (colocated on one GPU: planner/gpu_layout.py), the transport it takes
there (cuda_ipc), the dtype auto resolves to (bfloat16), the KV that auto leaves the core
(services/kv_budget.py) and the batch limit (256); `lamina status` names the GPU its
workers compute on. It needs a CUDA device and skips, saying so, elsewhere."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lamina.ports import free_port

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch finds none here)")]


def test_lamina_up_on_a_gpu_starts_colocated_in_bfloat16_and_serves(tmp_path: Path):
    import openai

    port = free_port()
    log_path = tmp_path / "lamina-up.log"
    with open(log_path, "wb") as log:
        up = subprocess.Popen([sys.executable, "-P", "-m", "lamina.cli", "up", "--device", "cuda",
                               "--model", "random:smollm2-135m", "--port", str(port),
                               "--profile", str(tmp_path / "profile.json")],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        deadline = time.monotonic() + 600
        while True:
            assert up.poll() is None, f"lamina up exited: {log_path.read_text()[-3000:]}"
            try:
                model = client.models.list().data[0].id
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "lamina up did not answer within 600 s"
                time.sleep(1)  # polling a port that opens when the stack is up: nothing to wait on
        reply = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 8
        printed = log_path.read_text()
        assert "layout auto: colocated on cuda:0" in printed, printed[-3000:]
        assert "lamina up: transport cuda_ipc (prefill, model and attention workers all compute on GPUs" in printed, \
            printed[-3000:]
        assert "transport cuda_ipc, request-level partitioning" in printed, printed[-3000:]
        assert "GiB per attention core (auto: 0.9 of" in printed, printed[-3000:]
        assert not (tmp_path / "profile.json").exists()  # the host's CPU was not measured for a GPU stack
        status = subprocess.run([sys.executable, "-P", "-m", "lamina.cli", "status", "--json", "--port", str(port)],
                                capture_output=True, text=True, timeout=120)
        assert status.returncode == 0, status.stderr
        devices = {s["kind"]: s["device"] for s in json.loads(status.stdout)["services"]}
        assert devices["model"] == devices["prefill"] == "cuda:0", devices
        up.send_signal(signal.SIGINT)  # Ctrl-C: the launcher's ordered stop
        assert up.wait(120) == 0, log_path.read_text()[-3000:]
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
