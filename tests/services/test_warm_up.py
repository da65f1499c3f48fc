"""The workers' warm-up (services/warm_up.py, `warm_up`): a made-up forward before a worker
serves, which touches nothing a request sees. The real model, a prefill worker's own
batch loop and forward thread, an attention worker's data-plane handler over TCP, in
this process (no Redis call is made here); the stack's workers reporting their warm-up
before they serve is tests/e2e/test_stack_api.py's."""

from __future__ import annotations

import asyncio

import pytest
import torch
from prefill_helpers import serving_prefill

from lamina.model.tokenizer import Tokenizer
from lamina.services.attention.attention_service import AttentionService
from lamina.services.config import AttentionSection, PrefillSection, StackConfig, load_config
from lamina.services.model.model_service import ModelService
from lamina.services.prefill.prefill_service import PrefillService
from lamina.services.protos import lamina_pb2
from lamina.services.warm_up import attend_own, warm_up_inputs

pytestmark = pytest.mark.timeout(300)

PROMPT = [(11 * i + 5) % 3000 + 200 for i in range(40)]


def test_warm_up_is_on_unless_configured_off():
    assert StackConfig().warm_up is True and load_config(env={}).warm_up is True
    assert load_config(env={"LAMINA_WARM_UP": "false"}).warm_up is False
    assert load_config(env={}, overrides={"warm_up": False}).warm_up is False


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
