"""With the real model (SmolLM2-135M-Instruct): a prefix-cache hit changes nothing in
the generated tokens; 4-bit quantized prefix KV changes them little."""

import pytest
import torch

from lamina.engine.prefix_prefill import prefill
from lamina.kvstore.prefix_cache import PrefixCache, PrefixCacheConfig
from lamina.kvstore.tiers import Tier

pytestmark = pytest.mark.timeout(900)  # CPU shared with other jobs: generous

BLOCK = 16
PROMPT = ("You are a helpful assistant. Here is a long shared document about the history "
          "of the city of Paris, its rivers, bridges, museums and the people who built "
          "them over many centuries. The document also covers the food, the markets and the "
          "long walks along the river at night. Question: what is the capital of France? "
          "Answer:")


@pytest.fixture(scope="module")
def loaded(loaded_model):
    # The real model is part of the install (`make test`); failing to load it is a failure.
    return loaded_model


def kv_block_bytes(cfg):
    return cfg.num_layers * 2 * BLOCK * cfg.num_kv_heads * cfg.head_dim * 4


def test_prefill_with_cache_hit_gives_exactly_the_same_tokens(loaded, tmp_path):
    model, cfg = loaded.model, loaded.config
    tokens = loaded.tokenizer.encode(PROMPT)
    assert len(tokens) > 3 * BLOCK
    base = prefill(model, tokens, max_new_tokens=12, eos_token_ids=cfg.eos_token_ids)
    for tier_layout in ("device", "host", "disk"):
        sizes = {"device": (64, 0, 0), "host": (1, 64, 0), "disk": (1, 1, 64)}[tier_layout]
        cache = PrefixCache(PrefixCacheConfig(
            block_size=BLOCK, device_bytes=sizes[0] * kv_block_bytes(cfg),
            host_bytes=sizes[1] * kv_block_bytes(cfg),
            disk_bytes=sizes[2] * 2 * kv_block_bytes(cfg),
            disk_dir=str(tmp_path / tier_layout)))
        cache.insert(tokens, base.kv)
        if tier_layout != "device":
            cache.insert([7] * BLOCK, base.kv[:, :, :BLOCK])  # pushes the prompt down
            assert cache.tier_distance(tokens) >= Tier.HOST
        # a longer prompt sharing the cached one, and one diverging mid-block
        for query in (tokens + loaded.tokenizer.encode(" Paris"), tokens[:-5]):
            ref = prefill(model, query, max_new_tokens=12, eos_token_ids=cfg.eos_token_ids)
            with cache.acquire(query) as h:
                assert h.num_tokens > 0
                hit = prefill(model, query, h.kv, max_new_tokens=12,
                              eos_token_ids=cfg.eos_token_ids)
            assert hit.num_cached_tokens == min(h.num_tokens, len(query) - 1)
            assert hit.generated == ref.generated, tier_layout
            torch.testing.assert_close(hit.logits, ref.logits, rtol=1e-4, atol=1e-3)
            torch.testing.assert_close(hit.kv, ref.kv, rtol=1e-4, atol=1e-4)


def test_4bit_quantized_prefix_bounded_effect_on_text(loaded):
    model, cfg, tok = loaded.model, loaded.config, loaded.tokenizer
    tokens = tok.encode_chat([{"role": "user", "content": PROMPT.removesuffix("Answer:")}])
    n_new = 24
    base = prefill(model, tokens, max_new_tokens=n_new, eos_token_ids=cfg.eos_token_ids)
    assert "Paris" in tok.decode(list(base.generated))
    nb = len(tokens) // BLOCK
    cache = PrefixCache(PrefixCacheConfig(block_size=BLOCK, device_bytes=nb * kv_block_bytes(cfg),
                                          host_bytes=4 * nb * kv_block_bytes(cfg),
                                          quantize_4bit=True, quant_group_size=64))
    cache.insert(tokens, base.kv)
    filler = [7 + i for i in range(nb * BLOCK)]
    cache.insert(filler, base.kv)  # pushes the prompt's blocks to the quantized host tier
    assert cache.tier_distance(tokens) == Tier.HOST
    with cache.acquire(tokens) as h:  # host -> device, dequantized on the way up
        assert h.num_tokens == nb * BLOCK
        q_kv = h.kv.clone()
    ref = base.kv[:, :, :nb * BLOCK]
    # KV error: at most half a quantization step of the value's 64-value group
    assert (q_kv - ref).abs().max() <= (ref.max() - ref.min()) / 30
    rel = float((q_kv - ref).norm() / ref.norm())
    assert rel < 0.2  # measured here: 0.13
    hit = prefill(model, tokens, q_kv, max_new_tokens=n_new, eos_token_ids=cfg.eos_token_ids)
    # Effect on the text (measured here: the first 3 tokens agree, then the wording
    # changes but the answer stays): same first token, the answer still there, and a
    # small divergence of the first next-token distribution.
    p = torch.softmax(base.logits, -1)
    q = torch.softmax(hit.logits, -1)
    kl = float((p * (p.clamp_min(1e-12).log() - q.clamp_min(1e-12).log())).sum())
    assert hit.generated[0] == base.generated[0]
    assert "Paris" in tok.decode(list(hit.generated))
    assert kl < 0.1, kl
