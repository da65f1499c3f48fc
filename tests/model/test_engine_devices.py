"""The engine off its CPU kernels: torch's own linears in another dtype (the path of
every device but the CPU, taken on the CPU in bfloat16), checked against transformers
in the same dtype; and what it refuses."""


import pytest
import torch
from precision_helpers import bfloat16_ties
from triton_helpers import INTERPRETER_OFF, NO_CUDA, NO_TRITON

from lamina.engine import Engine, EngineConfig, SamplingParams
from lamina.model.loader import load_model

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "My favourite colour is"]


@pytest.fixture(scope="module")
def unpacked():
    return load_model(packed=False)


def test_a_bfloat16_engine_decodes_as_transformers_bfloat16(unpacked):
    """Greedy, 16 tokens: every output's first tokens equal, and where an output parts from
    transformers' it is at a tie: transformers' own logits for the two tokens there are
    within two bfloat16 steps of each other and of the best. (How many outputs part depends
    on the CPU's bfloat16 kernels: 1 of these 4 prompts on an AMD EPYC, 2 on an Intel Xeon
    with AVX512-BF16, where transformers' cached generate and its own full forward disagree
    at one of them.)"""
    from transformers import AutoModelForCausalLM

    engine = Engine(unpacked, EngineConfig(dtype="bfloat16"))
    assert {p.dtype for p in unpacked.model.parameters()} == {torch.bfloat16}
    assert unpacked.model.model.inv_freq.dtype == torch.float32  # RoPE's frequencies stay float32
    hf = AutoModelForCausalLM.from_pretrained(str(unpacked.weights_dir), dtype=torch.bfloat16).eval()
    ids = [unpacked.tokenizer.encode(p) for p in PROMPTS]
    outs = engine.generate(ids, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(ids, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
        ours = out.output_token_ids
        assert ours[:2] == ref[:2]
        if ours == ref:
            continue
        i = next(i for i, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + ref[:i]])).logits[0, -1:]  # [1, V]
        assert bfloat16_ties(logits, torch.tensor([ours[i]]))[0], (i, float(logits[0, ours[i]]), float(logits.max()))
    assert engine.kv.num_sequences == 0 and engine.kv.dtype == torch.bfloat16


def _count_buffer_steps(monkeypatch) -> list[list[int]]:
    """The query lengths of every step the engine runs through BufferAttention, as it runs."""
    from lamina.engine import step

    taken: list[list[int]] = []

    class Counted(step.BufferAttention):
        def __init__(self, kv, batch):
            taken.append(list(batch.query_lens))
            super().__init__(kv, batch)

    monkeypatch.setattr(step, "BufferAttention", Counted)
    return taken


@NO_TRITON
@INTERPRETER_OFF
def test_the_gpus_batched_decode_path_equals_transformers_token_for_token(monkeypatch):
    """The path an engine on a GPU takes for its decode steps (BufferAttention: one launch
    a layer writes every sequence's new K, V into its buffer, one attends every row),
    taken here in float32 under Triton's interpreter in place of the CPU kernels: greedy,
    4 tokens, transformers' own tokens on every prompt. Here the prompts go to SDPA (the
    kernel's causal rows are tests/model/test_paged_decode.py's; under the interpreter
    they would take most of the time)."""
    from transformers import AutoModelForCausalLM

    from lamina.engine import step

    taken = _count_buffer_steps(monkeypatch)
    monkeypatch.setattr(step, "runs_natively", lambda device, dtype: False)
    monkeypatch.setattr(step, "paged_available", lambda device: True)
    monkeypatch.setattr(step, "BUFFER_ATTENTION_ROWS", 1)
    unpacked = load_model(packed=False)  # its own: the bfloat16 tests cast the module's copy
    engine = Engine(unpacked, EngineConfig())
    hf = AutoModelForCausalLM.from_pretrained(str(unpacked.weights_dir), dtype=torch.float32).eval()
    ids = [unpacked.tokenizer.encode(p) for p in PROMPTS]
    outs = engine.generate(ids, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(ids, outs):
        with torch.no_grad():  # transformers stops at EOS (one prompt's third token), the engine goes on
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=4, do_sample=False)[0, len(prompt):].tolist()
        assert len(ref) >= 3 and out.output_token_ids[:len(ref)] == ref
    assert len(taken) >= 3 and all(set(lens) == {1} for lens in taken)
    assert any(len(lens) == len(PROMPTS) for lens in taken)  # whole decode batches


def test_packed_weights_are_refused_off_the_cpu_kernels(loaded_model):
    with pytest.raises(ValueError, match=r"packed weights run on the CPU in float32.*packed=False"):
        Engine(loaded_model, EngineConfig(dtype="bfloat16"))
    with pytest.raises(ValueError, match="dtype must be float32, bfloat16 or float16"):
        EngineConfig(dtype="float64")


def test_lamina_generate_names_a_device_it_cannot_use(capsys):
    from lamina.cli import main

    assert main(["generate", "--prompt", "Hi", "--device", "gpu"]) == 2
    assert "lamina generate:" in capsys.readouterr().err
    assert main(["generate", "--prompt", "Hi", "--dtype", "bfloat16", "--weights", "q4"]) == 2
    assert "--weights q4 is packed for the CPU in float32" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["generate", "--prompt", "Hi", "--device", "cuda"]) == 2
        assert "torch finds no CUDA device here" in capsys.readouterr().err


def test_lamina_generate_in_bfloat16_prints_the_engines_tokens(unpacked, capsys):
    import json

    from lamina.cli import main
    from lamina.model.threads import set_compute_threads

    try:
        assert main(["generate", "--prompt", PROMPTS[0], "--dtype", "bfloat16", "--max-tokens", "6", "--json"]) == 0
    finally:
        set_compute_threads(1)  # as the suite runs (tests/conftest.py)
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"]
    engine = Engine(load_model(packed=False), EngineConfig(dtype="bfloat16"))
    (out,) = engine.generate([unpacked.tokenizer.encode(PROMPTS[0])], SamplingParams(max_tokens=6, temperature=0.0))
    assert printed == out.output_token_ids


@NO_CUDA
@pytest.mark.parametrize("whole_steps", [True, False], ids=["step-graphs", "slice-graphs"])
def test_the_engine_on_cuda_in_float32_equals_transformers_token_for_token(monkeypatch, whole_steps):
    """A random model of SmolLM2's shape (no GGUF file needed on a GPU machine), the
    same weights directory read by transformers. The outputs end at 32, 24, 16 and 8
    tokens, so the batch shrinks from 4 to 1 and the steps replay the graphs of buckets
    4, 2 and 1, a batch of 3 in bucket 4's graphs. Its decode steps replayed whole as
    CUDA graphs (lamina.model.step_graphs), or through BufferAttention with their slices
    replayed as CUDA graphs (`step_graphs=False`)."""
    from lamina.engine import engine as engine_module
    from lamina.model.hf_reference import reference_model

    loaded = load_model("random:smollm2-135m", packed=False)
    hf = reference_model(loaded.weights_dir, torch.float32)
    taken = _count_buffer_steps(monkeypatch)
    steps: list[list[int]] = []  # every step's query lengths
    run_step = engine_module.run_step

    def counted(split, kv, batch, *args):
        steps.append(list(batch.query_lens))
        return run_step(split, kv, batch, *args)

    monkeypatch.setattr(engine_module, "run_step", counted)
    engine = Engine(loaded, EngineConfig(device="cuda", step_graphs=whole_steps))
    assert engine.kv.device == torch.device("cuda")
    ids = [loaded.tokenizer.encode(p) for p in PROMPTS]
    lengths = [32, 24, 16, 8]
    outs = engine.generate(ids, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths])
    for prompt, out, n in zip(ids, outs, lengths):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=n, min_new_tokens=n, do_sample=False)
        assert out.output_token_ids == ref[0, len(prompt):].tolist()
    graphs = engine.graphs
    assert graphs is not None and graphs.failures == 0
    decode_steps = [lens for lens in steps if set(lens) == {1}]
    assert {len(PROMPTS), 3, 1} <= {len(lens) for lens in decode_steps}
    if whole_steps:
        whole = engine.step_graphs
        assert whole is not None and whole.failures == 0
        assert whole.replays == len(decode_steps) and whole.captures == 3  # buckets 4, 2, 1; 512 keys
        assert graphs.replays == 0 and all(set(lens) != {1} for lens in taken)  # the prompts' step only
    else:
        assert engine.step_graphs is None and [lens for lens in taken if set(lens) == {1}] == decode_steps
        # Every decode step replays every slice: the layers' and the last.
        assert graphs.replays == len(decode_steps) * (loaded.config.num_layers + 1)
