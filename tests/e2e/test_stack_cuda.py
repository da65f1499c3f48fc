"""The disaggregated decode on a GPU: prefill, model and attention workers on CUDA, a
random model of SmolLM2's shape (no GGUF file needs to reach a GPU machine), greedy
output through the OpenAI API equal to transformers' token for token in float32, over
cuda_ipc and tcp, with 1 and 2 micro-batches, Q-early on and off, request and head
partitioning, cuda_ipc's frames ordered by the hosts and on the GPU
(`data_plane.cuda_ipc_device_order`), and colocated (each model worker attending on its own
GPU core, its decode steps replayed whole as CUDA graphs); in bfloat16, greedy tokens
against transformers' bfloat16 and logprobs against the one-GPU engine's; and an attention
worker killed mid-decode on the GPU, rebuilt as on the CPU (with host- and device-ordered
frames). Runs only where CUDA is present (skipped, saying so, elsewhere)."""

from __future__ import annotations

import asyncio
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from e2e_helpers import complete, free_port, metric_total
from fault_helpers import MAX_TOKENS, PROMPTS, stream_all
from fault_helpers import pid as service_pid
from precision_helpers import bfloat16_ties

from lamina.services.config import (
    AttentionSection,
    DataPlaneSection,
    GatewaySection,
    ModelWorkerSection,
    PipelineSection,
    PrefillSection,
    SchedulerSection,
    StackConfig,
)
from lamina.services.launch.launcher import Stack

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)"),
              pytest.mark.timeout(900)]

MODEL = "random:smollm2-135m"
NEW_TOKENS = 16
# (transport, partitioning, attention workers, micro-batches, Q-early, layout[, device
# order]): every transport with both partitionings, both micro-batch counts and Q-early on
# and off; cuda_ipc's frames ordered on the GPU; and the colocated layout (each model
# worker attends on its own GPU core; two of them).
ROWS = [("cuda_ipc", "request", 2, 2, False, "disaggregated"), ("cuda_ipc", "head", 2, 1, True, "disaggregated"),
        ("tcp", "request", 1, 2, True, "disaggregated"), ("tcp", "head", 2, 1, False, "disaggregated"),
        ("cuda_ipc", "request", 2, 1, False, "colocated"), ("cuda_ipc", "request", 2, 2, True, "disaggregated", True)]


@pytest.fixture(scope="module")
def model_refs():
    """The random model's tokenizer and transformers' float32 greedy continuations (on the
    GPU) of PROMPTS as completions and as chats, from the same weights directory."""
    from lamina.model.hf_reference import reference_model
    from lamina.model.loader import load_model

    loaded = load_model(MODEL, packed=False)
    hf = reference_model(loaded.weights_dir, torch.float32, "cuda")
    tok = loaded.tokenizer

    def greedy(ids: list[int], n: int) -> list[int]:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=n, do_sample=False,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"))
        return out[0, len(ids):].tolist()

    prompts = [tok.encode(p) for p in PROMPTS[:4]]
    completions = {tuple(p): greedy(p, NEW_TOKENS) for p in prompts}
    chats = [tok.decode(greedy(tok.encode_chat([{"role": "user", "content": p}]), MAX_TOKENS)) for p in PROMPTS]
    return prompts, completions, chats


def _stack(transport: str, partition: str, workers: int, micro_batches: int, q_early: bool,
           layout: str = "disaggregated", device_order: bool = False, dtype: str = "float32",
           device: str = "cuda") -> Stack:
    colocated = layout == "colocated"
    config = StackConfig(model=MODEL, transport=transport, partition=partition, weights="float32", layout=layout,
                         gateway=GatewaySection(port=free_port()),
                         attention=AttentionSection(workers=workers, kv_capacity_bytes=256 << 20, device=device,
                                                    dtype=dtype),
                         model_worker=ModelWorkerSection(device=device, workers=workers if colocated else 1,
                                                         dtype=dtype),
                         prefill=PrefillSection(device=device, dtype=dtype),
                         pipeline=PipelineSection(micro_batches=micro_batches, q_early=q_early, min_micro_batch=1),
                         data_plane=DataPlaneSection(cuda_ipc_device_order=device_order),
                         # The graphs captured at start: batch buckets 1-8, one context bucket
                         # (512 keys: every prompt here and its completion fit).
                         scheduler=SchedulerSection(max_batch_size=8), warm_up_graph_keys=512)
    stack = Stack(config)
    stack.start(timeout_s=300)
    return stack


@pytest.mark.parametrize("row", ROWS, ids=["-".join(str(v) for v in r) for r in ROWS])
def test_greedy_through_the_stack_on_cuda_equals_transformers(row, model_refs):
    prompts, completions, _ = model_refs
    stack = _stack(*row)
    try:
        captured = _graph_captures(stack, row)
        with ThreadPoolExecutor(len(prompts)) as pool:  # at once: both micro-batches hold sequences
            outs = list(pool.map(lambda p: complete(stack, p, NEW_TOKENS, return_token_ids=True), prompts))
        for prompt, out in zip(prompts, outs):
            assert out["choices"][0]["token_ids"] == completions[tuple(prompt)]
        # The decode slices ran as CUDA graphs (a failed capture would run them eagerly, as
        # right); colocated, whole decode steps did (lamina.model.step_graphs.SlabStepGraphs).
        colocated = row[5] == "colocated"
        model_workers = row[2] if colocated else 1
        kind = "step_graph" if colocated else "graph"
        graphs = [(metric_total(stack, "model", f"model-{i}", f"lamina_model_{kind}_replays_total"),
                   metric_total(stack, "model", f"model-{i}", f"lamina_model_{kind}_capture_failures_total"))
                  for i in range(model_workers)]
        assert sum(r for r, _ in graphs) > 0 and all(f == 0 for _, f in graphs), graphs
        # Every graph the steps replayed was captured at start (warm_up_graph_keys): the
        # model workers' (and, with whole frames, the attention workers') before serving,
        # none since.
        assert captured["model"] > 0 and (captured["attention"] > 0) == (not colocated and not row[4]), captured
        assert _graph_captures(stack, row) == captured
    finally:
        stack.stop()


def _graph_captures(stack: Stack, row: tuple) -> dict[str, float]:
    """CUDA graphs the model workers and the attention workers have captured so far."""
    colocated = row[5] == "colocated"
    return {"model": sum(metric_total(stack, "model", f"model-{i}", "lamina_model_graph_captures_total")
                         for i in range(row[2] if colocated else 1)),
            "attention": 0.0 if colocated else sum(
                metric_total(stack, "attention", f"attention-{i}", "lamina_attention_graph_captures_total")
                for i in range(row[2]))}


DEVICE_ORDER_KILLED = pytest.mark.xfail(
    strict=False, reason="device-ordered cuda_ipc: whether a wait on a killed sender's event ever ends is the "
    "driver's (bench/gpu_handoff.py's event_exit; docs/transports.md)")


@pytest.mark.parametrize("device_order", [False, pytest.param(True, marks=DEVICE_ORDER_KILLED)],
                         ids=["host_ordered", "device_ordered"])
def test_a_killed_attention_worker_on_cuda_is_rebuilt(model_refs, device_order):
    """Eight greedy chat streams over cuda_ipc; attention-0 killed once every stream has three
    chunks: each stream ends with transformers' text, and the scheduler counted a rebuild.
    Device-ordered, the model worker's streams may have queued waits on the killed worker's
    events: if the driver never ends them, the model worker cannot go on (expected to fail
    until event_exit says what the driver does); if it does, a torn reply fails its step."""
    _, _, chats = model_refs
    stack = _stack("cuda_ipc", "request", 2, 2, False, device_order=device_order)
    try:
        victim = service_pid(stack, "attention-0")
        texts = asyncio.run(stream_all(stack.base_url, lambda: os.kill(victim, signal.SIGKILL), 3))
        assert texts == chats
        assert metric_total(stack, "scheduler", "scheduler-0", "lamina_scheduler_rebuilds_total") >= 1
    finally:
        stack.stop()


BF16_TOKENS = 64
# bfloat16 keeps 8 significant bits: the stack's and the engine's kernels sum in other
# orders, and their logprobs part by a few roundings of the logits. The same comparison
# on the CPU (tcp, every service and the engine in bfloat16) found at most 0.016 over 703
# positions.
LOGPROB_TOLERANCE = 0.1


def bfloat16_run(transport: str = "cuda_ipc", device: str = "cuda"):
    """16 prompts x BF16_TOKENS greedy tokens (EOS ignored) through the stack with prefill,
    model and attention workers in bfloat16 (two attention workers, two micro-batches): the loaded
    model, the prompts, and per prompt the stack's token ids and each token's logprob."""
    from lamina.model.loader import load_model

    loaded = load_model(MODEL, packed=False)
    tok = loaded.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS] + [tok.encode(p + " Answer in one word.") for p in PROMPTS]
    stack = _stack(transport, "request", 2, 2, False, dtype="bfloat16", device=device)
    try:
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda p: complete(stack, p, BF16_TOKENS, ignore_eos=True, return_token_ids=True,
                                                    logprobs=0), prompts))
    finally:
        stack.stop()
    runs = [(o["choices"][0]["token_ids"], o["choices"][0]["logprobs"]["token_logprobs"]) for o in outs]
    return loaded, prompts, runs


@pytest.fixture(scope="module")
def bfloat16_stack():
    return bfloat16_run()


def test_bfloat16_greedy_tokens_agree_with_transformers_bfloat16(bfloat16_stack):
    """Model and attention workers in bfloat16 on the GPU, 16 prompts x 64 greedy tokens (EOS
    ignored): at each position the stack's token is transformers-bfloat16's argmax given the
    same prefix (the stack's own), or ties with it at bfloat16's precision (a random
    model's logits are flat: two bfloat16 paths order near-equal ones apart), at least 95%
    of the time."""
    from lamina.model.hf_reference import reference_model

    loaded, prompts, runs = bfloat16_stack
    hf = reference_model(loaded.weights_dir, torch.bfloat16, "cuda")
    agree = exact = total = 0
    for prompt, (ids, _) in zip(prompts, runs):
        assert len(ids) == BF16_TOKENS
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + ids], device="cuda")).logits[0, len(prompt) - 1:-1]  # [64, V]
        chosen = torch.tensor(ids, device=logits.device)
        agree += int(bfloat16_ties(logits, chosen).sum())
        exact += int((logits.argmax(-1) == chosen).sum())
        total += len(ids)
    assert agree / total >= 0.95, f"{agree} of {total} positions agree ({exact} exactly)"


def compare_with_engine(loaded, prompts, runs, device: str = "cuda") -> list[float]:
    """The one-device engine in bfloat16 on the same prompts, greedy with logprobs: per
    prompt, over the positions before the stack's and the engine's tokens first part (the
    same context on both), the absolute differences of the chosen token's logprob."""
    from lamina.engine import Engine, EngineConfig, SamplingParams

    engine = Engine(loaded, EngineConfig(device=device, dtype="bfloat16"))
    outs = engine.generate(prompts, SamplingParams(max_tokens=BF16_TOKENS, temperature=0.0, ignore_eos=True,
                                                   logprobs=0))
    diffs = []
    for (ids, lps), out in zip(runs, outs):
        for mine, theirs, lp, lp_engine in zip(ids, out.output_token_ids, lps, out.logprobs):
            if mine != theirs:
                break
            diffs.append(abs(lp - lp_engine.logprob))
    return diffs


def test_bfloat16_stack_logprobs_equal_the_one_gpu_engines(bfloat16_stack):
    """The same 16 x 64 greedy tokens as the one-GPU engine gives in bfloat16, compared
    position by position while both decode the same context: the chosen token's logprob
    (a log-softmax of the step's logits, so every logit of the row counts) within
    LOGPROB_TOLERANCE of the engine's, over at least an eighth of all positions (a random
    model's next-token distribution is flat, so two bfloat16 paths part at near ties; on
    the CPU 703 of 1,024 were compared)."""
    loaded, prompts, runs = bfloat16_stack
    diffs = compare_with_engine(loaded, prompts, runs)
    assert len(diffs) >= len(prompts) * BF16_TOKENS // 8, f"tokens parted early: {len(diffs)} positions compared"
    assert max(diffs) <= LOGPROB_TOLERANCE, f"largest logprob difference {max(diffs):.4f}"
