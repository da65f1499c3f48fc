"""The workers' warm-up (services/warm_up.py, `warm_up`): a made-up forward before a worker
serves, which touches nothing a request sees. The real model, a prefill worker's own
batch loop and forward thread, an attention worker's data-plane handler over TCP, in
this process (no Redis call is made here); the stack's workers reporting their warm-up
before they serve is tests/e2e/test_stack_api.py's."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from prefill_helpers import serving_prefill
from triton_helpers import INTERPRETER_OFF, NO_TRITON

from lamina.model.slice_graphs import SliceGraphs
from lamina.model.tokenizer import Tokenizer
from lamina.services.attention.attention_service import AttentionService
from lamina.services.config import (
    AttentionSection,
    ConfigError,
    ModelWorkerSection,
    PipelineSection,
    PrefillSection,
    SchedulerSection,
    StackConfig,
    load_config,
)
from lamina.services.model.model_service import ModelService
from lamina.services.prefill.prefill_service import PrefillService
from lamina.services.protos import lamina_pb2
from lamina.services.warm_up import GraphPlan, attend_own, decode_inputs, graph_plan, warm_up_inputs

pytestmark = pytest.mark.timeout(300)

PROMPT = [(11 * i + 5) % 3000 + 200 for i in range(40)]
SENTINEL = 7.0  # what an attention worker's pools hold before its graphs are captured


def test_warm_up_is_on_unless_configured_off():
    assert StackConfig().warm_up is True and load_config(env={}).warm_up is True
    assert load_config(env={"LAMINA_WARM_UP": "false"}).warm_up is False
    assert load_config(env={}, overrides={"warm_up": False}).warm_up is False


def test_graphs_are_captured_at_start_up_to_the_largest_batch_and_the_keys_set():
    """warm_up_graph_keys: every batch bucket a step of up to max_batch_size sequences
    takes, every context bucket up to the keys set (at most the model's context); 0 or
    no warm-up: none."""
    config = load_config(env={}, overrides={"scheduler.max_batch_size": 100})
    assert config.warm_up_graph_keys == 4096
    assert graph_plan(config, 8192) == GraphPlan((1, 2, 4, 8, 16, 32, 64, 128), (512, 1024, 2048, 4096))
    assert graph_plan(config, 1000) == GraphPlan((1, 2, 4, 8, 16, 32, 64, 128), (512, 1024))
    gpu = load_config(env={"LAMINA_MODEL_DEVICE": "cuda", "LAMINA_WARM_UP_GRAPH_KEYS": "600"})
    assert graph_plan(gpu, 8192) == GraphPlan((1, 2, 4, 8, 16, 32, 64, 128, 256), (512, 1024))
    assert graph_plan(load_config(env={"LAMINA_WARM_UP_GRAPH_KEYS": "0"}), 8192) is None
    assert graph_plan(load_config(env={"LAMINA_WARM_UP": "no"}), 8192) is None
    with pytest.raises(ConfigError, match="warm_up_graph_keys must be a non-negative integer"):
        load_config(env={"LAMINA_WARM_UP_GRAPH_KEYS": "-1"})


def _request(seq_id: str) -> lamina_pb2.PrefillRequest:
    """The prompt, computed whole each time (its own tokens' logprobs asked: no cached prefix read)."""
    return lamina_pb2.PrefillRequest(seq_id=seq_id, token_ids=PROMPT, params=lamina_pb2.SamplingParams(max_tokens=1),
                                     placement=lamina_pb2.Placement(workers=[0]), prompt_logprobs=True)


async def test_a_prefill_workers_warm_up_changes_nothing_a_prompt_gets():
    """A prompt prefilled before the warm-up and again after it gets the same first token
    and leaves the same KV at its attention worker; the warm-up itself sent nothing there,
    cached nothing (the cache is on), counted no prompt and left the forward rate the
    scheduler reads as the real forward made it. (The prompt is computed whole both times,
    so the second reads nothing the first cached.)"""
    config = StackConfig(redis_url="redis://127.0.0.1:1", attention=AttentionSection(workers=1,
                                                                                     kv_capacity_bytes=64 << 20),
                         prefill=PrefillSection(cache_device_bytes=64 << 20, prefetch=False))
    svc, attention = PrefillService(config), AttentionService(config)
    slabs = attention.core.slabs
    assert svc.cache is not None
    async with serving_prefill(svc, attention):
        before = await asyncio.wait_for(svc.prefill(_request("before")), 120)
        kv_before = [tuple(t.clone() for t in slabs.read("before", i)) for i in range(svc.cfg.num_layers)]
        attention.core.free(["before"])
        blocks, rate = svc.cache.num_blocks(), svc.compute_tokens_per_s
        assert blocks == len(PROMPT) // config.prefill.cache_block_tokens
        assert rate is not None and svc.runtime.registry.get_sample_value("lamina_prefill_warm_up_seconds") == 0.0

        seconds = await svc.warm_up()
        assert seconds > 0 and svc.runtime.registry.get_sample_value("lamina_prefill_warm_up_seconds") == seconds
        assert slabs.num_requests == 0 and svc.cache.num_blocks() == blocks
        assert svc.compute_tokens_per_s == rate
        assert svc.runtime.registry.get_sample_value("lamina_prefill_requests_total") == 1

        after = await asyncio.wait_for(svc.prefill(_request("after")), 120)
        assert after.token_id == before.token_id and after.prompt_logprobs == before.prompt_logprobs
        for (k1, v1), (k2, v2) in zip(kv_before, [slabs.read("after", i) for i in range(svc.cfg.num_layers)],
                                      strict=True):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_a_model_workers_warm_up_leaves_its_slices_as_they_were():
    """The warm-up step runs the slices (reusing their outputs, as the decode steps do)
    and is not counted as step compute; a step's logits after it equal the logits before."""
    svc = ModelService(StackConfig(redis_url="redis://127.0.0.1:1"))
    inputs = warm_up_inputs(svc.slices.cfg.vocab_size, 3, svc.slices.device)

    def logits() -> torch.Tensor:
        with torch.inference_mode():
            return svc.slices.split.run(inputs, attend_own, reuse_outputs=True).clone()  # [1, V]

    first = logits()
    seconds = svc.warm_up()
    assert seconds > 0 and svc.runtime.registry.get_sample_value("lamina_model_warm_up_seconds") == seconds
    assert svc.slices.compute_s == 0.0
    assert torch.equal(logits(), first)


@pytest.mark.parametrize("mode", ["fixed", "rotational"])
def test_a_model_workers_warm_up_captures_each_micro_batchs_slice_graphs(mode):
    """On a GPU the warm-up captures every micro-batch's decode slices for every batch
    bucket up to max_batch_size (here SliceGraphs without capture, the CPU's: each "graph"
    runs its slice over the static tensors). A later step of 3 sequences then captures
    nothing, replays each slice of bucket 4 and gives the eager logits; the warm-up's own
    replays are not counted, its captures are. Rotational steps replay no graphs: none is made."""
    config = StackConfig(redis_url="redis://127.0.0.1:1", scheduler=SchedulerSection(max_batch_size=3),
                         pipeline=PipelineSection(micro_batches=2, mode=mode))
    svc = ModelService(config)
    graphs = svc.slices.graphs = SliceGraphs(svc.slices.split, svc.slices.device, capture=False)
    slices = len(svc.slices.split.slices)
    seconds = svc.warm_up()
    assert seconds > 0 and svc.runtime.registry.get_sample_value("lamina_model_warm_up_seconds") == seconds
    if mode == "rotational":
        assert (graphs.captures, graphs.replays) == (0, 0)
        return
    assert config.decode_micro_batches == 2
    assert (graphs.captures, graphs.replays, graphs.failures) == (2 * 3 * slices, 0, 0)  # buckets 1, 2, 4
    metric = svc.runtime.registry.get_sample_value
    assert metric("lamina_model_graph_captures_total") == 2 * 3 * slices
    assert metric("lamina_model_graph_replays_total") == 0.0
    assert svc.slices.compute_s == 0.0
    inputs = decode_inputs(svc.slices.cfg.vocab_size, 3, svc.slices.device)
    with torch.inference_mode():
        want = svc.slices.split.run(inputs, attend_own).clone()  # [3, V]
        got = svc.slices.split.run(inputs, attend_own, call_slice=graphs.caller(1))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (graphs.captures, graphs.replays) == (2 * 3 * slices, slices)


def test_a_gpu_out_of_memory_at_start_leaves_the_other_graphs_to_their_first_step(monkeypatch, caplog):
    """Out of memory while capturing at start (here made up at batch bucket 4): the worker
    keeps what it made (micro-batch 0's buckets 1 and 2), says so and serves; the step
    that needs bucket 4 captures it then, as without the plan."""
    config = StackConfig(redis_url="redis://127.0.0.1:1", scheduler=SchedulerSection(max_batch_size=3),
                         pipeline=PipelineSection(micro_batches=2))
    svc = ModelService(config)
    graphs = svc.slices.graphs = SliceGraphs(svc.slices.split, svc.slices.device, capture=False)
    slices = len(svc.slices.split.slices)
    capture = SliceGraphs._capture

    def out_of_memory_at_4(self, micro_batch, j, bucket, *args):
        if bucket == 4:
            raise torch.OutOfMemoryError("CUDA out of memory (made up)")
        return capture(self, micro_batch, j, bucket, *args)

    monkeypatch.setattr(SliceGraphs, "_capture", out_of_memory_at_4)
    with caplog.at_level("WARNING", logger="lamina.services.model.model_service"):
        assert svc.warm_up() > 0
    assert (graphs.captures, graphs.replays) == (2 * slices, 0)
    (record,) = [r for r in caplog.records if "stopped after" in r.getMessage()]
    assert f"stopped after {2 * slices}, out of memory" in record.getMessage()
    assert svc.runtime.registry.get_sample_value("lamina_model_graph_captures_total") == 2 * slices
    monkeypatch.setattr(SliceGraphs, "_capture", capture)
    inputs = decode_inputs(svc.slices.cfg.vocab_size, 3, svc.slices.device)
    with torch.inference_mode():
        want = svc.slices.split.run(inputs, attend_own).clone()  # [3, V]
        got = svc.slices.split.run(inputs, attend_own, call_slice=graphs.caller(0))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (graphs.captures, graphs.replays) == (3 * slices, slices)


def test_nothing_is_captured_at_start_where_no_graphs_exist():
    """Where no graphs exist (the CPU's slices, the native attention core) the warm-up
    captures nothing and says so by its count."""
    config = StackConfig(redis_url="redis://127.0.0.1:1")
    assert ModelService(config).capture_graphs() == 0
    assert AttentionService(config).capture_graphs() == 0


@INTERPRETER_OFF
@NO_TRITON
@pytest.mark.parametrize(("change", "made"), [({}, 30), ({"pipeline": PipelineSection(q_early=True)}, 0),
                                              ({"model_worker": ModelWorkerSection(dtype="float32")}, 0),
                                              ({"warm_up_graph_keys": 0}, 0)],
                         ids=["whole-frames", "q-early", "other-dtype", "keys-0"])
def test_an_attention_workers_graphs_are_captured_at_its_start_where_frames_replay_them(change, made, monkeypatch):
    """An attention worker whose core attends through graphs (here the paged kernel in
    bfloat16 on the CPU, its bodies run once under Triton's interpreter instead of
    captured) captures every layer's graph of the plan's buckets before it serves (one
    batch bucket, one context bucket: 30 layers), counts them and writes nothing into its
    pools; none where frames would not replay them (Q-early's halves, Q in another dtype
    than the pools') or where the keys are 0."""
    from lamina.model.attend_graphs import AttendGraphs

    monkeypatch.setattr("lamina.services.attention.attention_core.paged_available", lambda device: True)
    prepare = AttendGraphs.prepare

    def prepare_over_marked_pools(graphs: AttendGraphs, *args) -> int:
        for pool in (*graphs.k_pools, *graphs.v_pools):
            pool.fill_(SENTINEL)  # what a write would change
        return prepare(graphs, *args)

    monkeypatch.setattr(AttendGraphs, "prepare", prepare_over_marked_pools)
    config = StackConfig(redis_url="redis://127.0.0.1:1", model="random:smollm2-135m", weights="float32",
                         attention=AttentionSection(workers=1, kv_capacity_bytes=64 << 20, dtype="bfloat16"),
                         model_worker=ModelWorkerSection(dtype="bfloat16"),
                         scheduler=SchedulerSection(max_batch_size=1), warm_up_graph_keys=512)
    svc = AttentionService(dataclasses.replace(config, **change))
    graphs = svc.core.graphs
    assert graphs is not None and (graphs.captures, graphs.replays, graphs.failures) == (made, 0, 0)
    assert svc.runtime.registry.get_sample_value("lamina_attention_graph_captures_total") == made
    if made:
        assert all(bool((pool == SENTINEL).all()) for pool in (*svc.core.slabs.k_pools, *svc.core.slabs.v_pools))
    assert svc.capture_graphs() == 0  # made already, or not to be made


def test_the_gateways_tokenizer_warm_up_makes_what_the_first_request_waits_for():
    tok = Tokenizer.from_dir(*_tokenizer_dir())
    assert "max_token_chars" not in vars(tok)
    tok.warm_up()
    assert vars(tok)["max_token_chars"] == max(map(len, tok.hf_tokenizer.get_vocab()))
    assert tok.encode_chat([{"role": "user", "content": "Hi"}])  # still answers after


def _tokenizer_dir():
    from lamina.model.checkpoints import load_config as load_model_config
    from lamina.model.loader import resolve_checkpoint

    _, weights_dir, _ = resolve_checkpoint(None)
    return weights_dir, load_model_config(None)
